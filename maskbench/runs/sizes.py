"""Every shipped arm's parameter count beside its baseline's (`maskbench arms --sizes`).

An arm compared at another size than its baseline mixes its method's effect with the capacity it adds, so the
leaderboard refuses such pairs (`results.summary.SIZE_TOLERANCE`); this lists, before any run, which arms
would be refused and by how much.
"""

from __future__ import annotations

from dataclasses import dataclass

from maskbench.config import load_config
from maskbench.config.compose import known_arms
from maskbench.data.dataset import resolve_dataset
from maskbench.errors import ConfigError
from maskbench.models.build import count_params
from maskbench.results.summary import SIZE_TOLERANCE


@dataclass(frozen=True)
class ArmSize:
    arm: str
    params: int | None         # None: the arm does not run on this model, `why` says why
    baseline_params: int
    why: str = ""

    @property
    def change(self) -> float:
        """The arm's parameters over the baseline's, less one (+0.46: 46% more)."""
        return self.params / self.baseline_params - 1

    @property
    def within(self) -> bool:
        return self.params is not None and abs(self.change) <= SIZE_TOLERANCE


def params_of(overrides: list[str]) -> int:
    """The parameter count of the model `maskbench run OVERRIDES` would train (nothing is generated or run)."""
    cfg = load_config(overrides)
    return count_params(cfg.model, resolve_dataset(cfg.data, cfg.paths.data, create=False))


def arm_sizes(model: str, baseline: str = "mask0", arms: list[str] | None = None) -> list[ArmSize]:
    """Each arm's parameter count on `model`, beside `baseline`'s on the same model."""
    base = params_of([f"arm={baseline}", f"model={model}"])
    return [_size(arm, model, base) for arm in arms or known_arms()]


def _size(arm: str, model: str, baseline_params: int) -> ArmSize:
    try:
        return ArmSize(arm, params_of([f"arm={arm}", f"model={model}"]), baseline_params)
    except ConfigError as err:  # e.g. a conversion arm needs a trained source (init_from)
        return ArmSize(arm, None, baseline_params, str(err))


def render_sizes(sizes: list[ArmSize], model: str, baseline: str = "mask0") -> str:
    """One line per arm: its parameters, the change from the baseline's, and whether the leaderboard pairs it."""
    width = max(len(size.arm) for size in sizes)
    lines = [f"parameters on {model}, against {baseline}'s (the leaderboard pairs arms within "
             f"±{SIZE_TOLERANCE:.0%}; --allow-size-mismatch pairs the others)"]
    for size in sizes:
        if size.params is None:
            lines.append(f"{size.arm:{width}s} {'-':>12s} {'':7s}  not sized: {size.why}")
            continue
        verdict = "pairs" if size.within else "beyond the tolerance: not paired by default"
        lines.append(f"{size.arm:{width}s} {size.params:>12,} {size.change:+7.1%}  {verdict}")
    return "\n".join(lines)
