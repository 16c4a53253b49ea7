"""The techniques a training step can carry, what turns each on in a run, and which cannot share a step.

Declared once, as data: `models.inputs.StepInputs` has one field per technique (the cosine rule's probe
excepted: it is a measurement inside the step) and refuses two that cannot share a step when built, and
`validate` refuses a run whose steps would hold them, before any work. A new technique is an entry here,
a field of `StepInputs`, and the code that reads it.
"""

from __future__ import annotations

from collections.abc import Callable

from maskbench.config.schema import RunConfig, demote_routes

# name -> (what turns it on, as a user reads it; whether a run's config turns it on)
TECHNIQUES: dict[str, tuple[str, Callable[[RunConfig], bool]]] = {
    "keep_idx": ("token dropping (a phase's mask_ratio > 0)", lambda c: any(p.mask_ratio > 0 for p in c.arm.phases)),
    "span_idx": ("TREAD's routing (model.route_ratio)", lambda c: c.model.route_ratio > 0),
    "drop_path": ("SPRINT's path drop (model.path_drop)", lambda c: bool(c.model.path_drop)),
    "demotion": ("train.demote_routes / downscale_window", lambda c: bool(demote_routes(c.train))),
    "repa": ("REPA (train.repa_weight)", lambda c: bool(c.train.repa_weight)),
    "cosine_probe": ("the cosine rule (until.grad_cosine_below)",
                     lambda c: any(p.until is not None and p.until.grad_cosine_below is not None for p in c.arm.phases)),
}

# Pairs that cannot run in one step, and why.
EXCLUSIVE: dict[frozenset[str], str] = {
    frozenset({"demotion", "keep_idx"}): "downscaled steps and token dropping are separate arms",
    frozenset({"demotion", "span_idx"}): "downscaled steps and TREAD's routing are separate arms",
    frozenset({"demotion", "drop_path"}): "downscaled samples train on every token in every block",
    frozenset({"demotion", "repa"}): "REPA aligns native-resolution tokens",
    frozenset({"cosine_probe", "repa"}): "the cosine rule's probe compares flow-loss gradients alone",
    frozenset({"cosine_probe", "span_idx"}): "the cosine rule's probe compares flow-loss gradients alone",
    frozenset({"cosine_probe", "drop_path"}): "the cosine rule's probe compares flow-loss gradients alone",
}


def techniques_of(cfg: RunConfig) -> set[str]:
    """The techniques some step of this run would use."""
    return {name for name, (_, used) in TECHNIQUES.items() if used(cfg)}


def refuse_exclusive(on: set[str], described: bool = False) -> str | None:
    """The first reason the techniques `on` cannot share a step, or None; `described`: name them as a user
    sets them rather than by their `StepInputs` field."""
    for pair, why in EXCLUSIVE.items():
        if pair <= on:
            first, second = (TECHNIQUES[name][0] if described else name for name in sorted(pair))
            return f"{first} and {second} cannot share a step: {why}"
    return None
