"""A step's technique inputs draw themselves: each `StepInputs` field from its own purpose's stream, so a technique
switched on, or a new one added, moves no other draw (arms with one seed stay paired)."""

from __future__ import annotations

import copy
from dataclasses import make_dataclass

import pytest
import torch

from maskbench.config import RunConfig, load_config
from maskbench.config import techniques as declared
from maskbench.errors import ConfigError
from maskbench.models.inputs import StepContext, StepInputs, drawn_by
from maskbench.train import schedule
from maskbench.train.schedule import step_generator

B, GRID = 6, (8, 8)


def _context(cfg: RunConfig, mask_ratio: float = 0.75) -> StepContext:
    """Step 3 of stream 0 of seed 0, on an 8×8 token grid."""
    return StepContext(cfg, {"image": torch.zeros(B, 3, 16, 16)}, mask_ratio, demote=False, seq_len=64, grid=GRID,
                       device=torch.device("cpu"), make_generator=lambda purpose: step_generator(0, 0, 3, purpose))


def test_switching_a_technique_on_moves_no_other_draw() -> None:
    cfg = load_config(["arm=mask75"])
    plain = StepInputs.draw(_context(cfg))
    assert plain.keep_idx.shape == (B, 16) and plain.span_idx is None and plain.drop_path is None

    routed = StepInputs.draw(_context(load_config(["arm=tread50_mask75"])))  # TREAD's route continues the mask's stream
    assert torch.equal(routed.keep_idx, plain.keep_idx)
    assert routed.span_idx.shape == (B, 8)

    dropping = copy.deepcopy(cfg)
    dropping.model.path_drop = 0.5
    dropped = StepInputs.draw(_context(dropping))
    assert torch.equal(dropped.keep_idx, plain.keep_idx)
    assert torch.equal(dropped.drop_path, torch.rand(B, generator=step_generator(0, 0, 3, "path_drop")) < 0.5)


def test_the_draws_keep_the_keys_every_committed_row_was_drawn_with() -> None:
    """A purpose's index keys its stream: reordering StepInputs' drawn fields would change every run's draws."""
    assert schedule.DRAWS == ("t", "dropout", "noise", "mask", "demote", "path_drop")


def draw_toy_scale(step: StepContext, generator: torch.Generator, _drawn) -> torch.Tensor:
    """The toy technique's own module: a per-sample loss scale in [0.5, 1.5)."""
    return torch.rand(step.size, generator=generator) + 0.5                                     # B


def test_a_new_technique_is_its_draw_a_step_inputs_field_and_one_declaration(monkeypatch) -> None:
    # 1. its own module: `draw_toy_scale` above; 2. a field of the step-inputs object:
    toy_inputs = make_dataclass("ToyInputs", [("scale", torch.Tensor | None, drawn_by(draw_toy_scale, "toy_scale"))],
                                bases=(StepInputs,), frozen=True)
    # 3. one declaration: what turns it on and what it cannot share a step with.
    monkeypatch.setitem(declared.TECHNIQUES, "scale", ("the toy scale (always on)", lambda cfg: True))
    monkeypatch.setitem(declared.EXCLUSIVE, frozenset({"scale", "span_idx"}), "the toy scales whole samples")

    assert toy_inputs.purposes() == (*StepInputs.purposes(), "toy_scale")  # a stream of its own, after the others
    monkeypatch.setattr(schedule, "DRAWS", ("t", "dropout", "noise", *toy_inputs.purposes()))
    cfg = load_config(["arm=mask75"])
    toy, plain = toy_inputs.draw(_context(cfg)), StepInputs.draw(_context(cfg))
    assert torch.equal(toy.keep_idx, plain.keep_idx)
    assert torch.equal(toy.scale, torch.rand(B, generator=step_generator(0, 0, 3, "toy_scale")) + 0.5)

    with pytest.raises(ConfigError, match=r"the toy scale \(always on\) and TREAD's routing .* cannot share a step"):
        load_config(["arm=tread50_mask75"])
    tread = copy.deepcopy(cfg)
    tread.model.route_ratio = 0.5
    with pytest.raises(ValueError, match="scale and span_idx cannot share a step: the toy scales whole samples"):
        toy_inputs.draw(_context(tread))
