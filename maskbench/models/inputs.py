"""What a training step drew for its techniques, as one object from the trainer's draws to the forward.

Token dropping, TREAD's route, SPRINT's path drop, demotion and REPA each need something per step: the
tokens kept, the tokens routed, the samples whose deep path is dropped, the smaller size some samples train
at, an extra loss term. They travel together in `StepInputs` from `Trainer.step_draws` through the loss
(`objective.windowed_flow_loss`, `objective.flow_loss`) into `DiT.forward`, so a new technique adds a field
here and reads it where it acts, not a parameter at every level in between. Sampling and validation pass
none: every field None is a plain full-token forward.

Which techniques cannot share a step is declared once, in `config.techniques` (plain data, so the config
layer refuses such a run before any work): a `StepInputs` holding two of them is refused when built too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace

import torch

from maskbench.config import DemoteRoute
from maskbench.config.techniques import refuse_exclusive


@dataclass(frozen=True)
class Demotion:
    """Demotion's per-step inputs: the routes some samples train on at a smaller size (`objective.route_choice`)."""
    routes: Sequence[DemoteRoute]
    gate: str = "sample"                                  # "sample": each sample its route; "batch": anima's gate
    generator: torch.Generator | None = None              # fresh noise of a non-integer ratio
    demoted: Mapping[str, torch.Tensor] | None = None     # latent data's demoted x0 per ratio (B×C×s×s), on the device


@dataclass(frozen=True)
class StepInputs:
    """One step's technique inputs; None: the technique is off in this step."""
    keep_idx: torch.Tensor | None = None      # B×K sorted kept tokens (token dropping); None: all L
    span_idx: torch.Tensor | None = None      # B×R sorted positions among the K, the tokens TREAD routes
    drop_path: torch.Tensor | None = None     # B bool, SPRINT's dropped deep paths
    demotion: Demotion | None = None          # samples trained at a smaller size
    repa: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None  # REPA's λ·loss(x0, keep_idx)

    def __post_init__(self) -> None:
        on = {f.name for f in fields(self) if getattr(self, f.name) is not None}
        if self.demotion is not None and not self.demotion.routes:
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
