"""What a training step drew for its techniques, as one object from the trainer's draws to the forward.

Token dropping, TREAD's route, SPRINT's path drop, demotion and REPA each need something per step: the
tokens kept, the tokens routed, the samples whose deep path is dropped, the smaller size some samples train
at, an extra loss term. They travel together in `StepInputs` from the trainer through the loss
(`objective.windowed_flow_loss`, `objective.flow_loss`) into `DiT.forward`, so a new technique adds a field
here and reads it where it acts, not a parameter at every level in between. Sampling and validation pass
none: every field None is a plain full-token forward.

Each drawn field carries its draw and the purpose whose generator it draws from (`drawn_by`): `StepInputs.draw`
makes them all from a `StepContext`, so the trainer has no line per technique, and a new technique's purpose
keys a stream of its own (`train.schedule.DRAWS`), so it moves no other draw and arms with one seed stay
paired. Which techniques cannot share a step is declared once, in
`config.techniques` (plain data, so the config layer refuses such a run before any work): a `StepInputs`
holding two of them is refused when built too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from maskbench.config import DemoteWindow, RunConfig, demote_routes
from maskbench.config.techniques import refuse_exclusive
from maskbench.models.masking import draw_path_drop, random_keep_idx
from maskbench.models.routing import draw_token_route


@dataclass
class StepContext:
    """What a technique's draw reads: the run, its phase's mask ratio and demotion, one stream's micro-batch,
    the model's token grid, and the step's generators, one per purpose (`generator`)."""
    cfg: RunConfig
    batch: dict                                           # the loader's micro-batch, on the host
    mask_ratio: float                                     # the phase's
    demote: bool                                          # whether the phase trains some samples demoted
    seq_len: int                                          # L, the model's tokens per image
    grid: tuple[int, int]                                 # its (h, w) token grid
    device: torch.device
    make_generator: Callable[[str], torch.Generator]      # purpose -> the step's generator for it
    generators: dict[str, torch.Generator] = field(default_factory=dict)  # those made so far

    @property
    def size(self) -> int:
        """b, the micro-batch's samples."""
        return self.batch["image"].shape[0]

    def generator(self, purpose: str) -> torch.Generator:
        """The step's generator for `purpose`, made once: two draws of one purpose continue one stream (TREAD's
        route is drawn from the "mask" generator after the mask, so an arm without a route draws as before)."""
        if purpose not in self.generators:
            self.generators[purpose] = self.make_generator(purpose)
        return self.generators[purpose]


# (the step, its generator of the field's purpose, the fields drawn before) -> the field's value
Draw = Callable[[StepContext, torch.Generator, Mapping[str, Any]], Any]


def drawn_by(draw: Draw, purpose: str) -> Any:
    """A `StepInputs` field that `draw` fills each training step from the generator of `purpose`; None by
    default (sampling, validation)."""
    return field(default=None, metadata={"draw": draw, "purpose": purpose})


@dataclass(frozen=True)
class Demotion:
    """Demotion's per-step inputs: the routes some samples train on at a smaller size (`objective.window_choice`)."""
    windows: Sequence[DemoteWindow]
    gate: str = "sample"                                  # "sample": each sample its route; "batch": anima's gate
    generator: torch.Generator | None = None              # fresh noise of a non-integer ratio
    demoted: Mapping[str, torch.Tensor] | None = None     # latent data's demoted x0 per ratio (B×C×s×s), on the device

    @classmethod
    def draw(cls, step: StepContext, generator: torch.Generator, _drawn: Mapping[str, Any]) -> Demotion | None:
        """The routes of a phase that demotes, with latent data's demoted x0 on the device (the loss indexes
        it by t there); None in a phase that does not, or without routes."""
        routes = demote_routes(step.cfg.train)
        if not (routes and step.demote):
            return None
        demoted = {ratio: x.to(step.device, non_blocking=True) for ratio, x in step.batch.get("demoted", {}).items()}
        return cls(routes, step.cfg.train.demote_gate, generator, demoted or None)


@dataclass(frozen=True)
class StepInputs:
    """One step's technique inputs; None: the technique is off in this step."""
    # Drawn in this order (TREAD's route continues the mask's stream); a new technique's field goes last
    # among them, so its purpose appends to the draws' keys (`train.schedule.DRAWS`).
    keep_idx: torch.Tensor | None = drawn_by(lambda s, gen, _: random_keep_idx(  # B×K sorted kept; None: all L
        s.size, s.seq_len, s.mask_ratio, gen, s.device, s.grid, s.cfg.model.structured_mask), "mask")
    span_idx: torch.Tensor | None = drawn_by(lambda s, gen, d: draw_token_route(  # B×R sorted, among K: TREAD's
        s.cfg.model, s.size, s.seq_len, d["keep_idx"], gen, s.device), "mask")
    demotion: Demotion | None = drawn_by(Demotion.draw, "demote")                # samples trained at a smaller size
    drop_path: torch.Tensor | None = drawn_by(lambda s, gen, _: draw_path_drop(  # B bool, SPRINT's dropped paths
        s.size, s.cfg.model.path_drop, gen, s.device), "path_drop")
    # Built once by the trainer (a trained part, not a draw):
    repa: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None  # REPA's λ·loss(x0, keep_idx)

    @classmethod
    def draw(cls, step: StepContext, **built: Any) -> StepInputs:
        """Every drawn field from its own draw, in field order, and the `built` ones as given."""
        drawn: dict[str, Any] = {}
        for f in fields(cls):
            if "draw" in f.metadata:
                drawn[f.name] = f.metadata["draw"](step, step.generator(f.metadata["purpose"]), drawn)
        return cls(**drawn, **built)

    @classmethod
    def purposes(cls) -> tuple[str, ...]:
        """The purposes the drawn fields draw from, each once, in field order."""
        return tuple(dict.fromkeys(f.metadata["purpose"] for f in fields(cls) if "purpose" in f.metadata))

    def __post_init__(self) -> None:
        on = {f.name for f in fields(self) if getattr(self, f.name) is not None}
        if self.demotion is not None and not self.demotion.windows:
            on.discard("demotion")
        if (why := refuse_exclusive(on)) is not None:
            raise ValueError(why)

    def rows(self, index: torch.Tensor) -> StepInputs:
        """The per-sample inputs (kept tokens, TREAD's span, SPRINT's path drop) of the samples `index` picks: a
        rule probe's part. The demotion is left whole: it draws which samples it takes when the loss runs."""
        per_sample = ("keep_idx", "span_idx", "drop_path")
        return replace(self, **{name: getattr(self, name)[index] for name in per_sample
                                if getattr(self, name) is not None})

    def unmasked(self) -> StepInputs:
        """The same step with every token kept (the full-token gradient a rule's probe compares with)."""
        return replace(self, keep_idx=None)


FULL = StepInputs()  # every token, every block, native size: sampling, validation, a full-token loss
