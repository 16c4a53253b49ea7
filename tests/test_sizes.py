"""Arms at their baseline's size: SPRINT re-splits the baseline's blocks instead of adding some, and every
arm that re-splits a model (SPRINT, MaskDiT's decoder, TREAD's span) stays within the leaderboard's size
tolerance of mask0 on the default model and on tiny."""

import re

import pytest

from maskbench.cli import main
from maskbench.config import known_arms, load_config
from maskbench.errors import ConfigError
from maskbench.results.summary import SIZE_TOLERANCE
from maskbench.runs.sizes import arm_sizes, params_of

RESPLIT_ARMS = ["sprint75", "maskdit50", "maskdit50_authors", "tread50"]


def blocks(overrides: list[str]) -> int:
    model = load_config(overrides).model
    return model.mixer_depth + model.depth + model.decoder_depth


@pytest.mark.parametrize("model", ["micro_s", "tiny"])
def test_sprint_keeps_the_baselines_blocks(model):
    """SPRINT's 2 + 24 + 2 blocks are SiT-XL's 28: its dense mixer and decoder come out of the baseline's blocks
    (micro_s: 1 + 3 + 1 = 5; tiny: 1 + 2 + 1 = 4), so its sparse tokens pass through as many blocks."""
    sprint = load_config(["arm=sprint75", f"model={model}"]).model
    assert sprint.resplit and (sprint.mixer_depth, sprint.decoder_depth) == (1, 1)
    assert blocks(["arm=sprint75", f"model={model}"]) == blocks(["arm=mask0", f"model={model}"])


def test_resplit_reads_the_command_lines_depth_as_the_baselines():
    """model.depth=6 names the baseline's backbone (mask0 with it has 1 + 6 blocks), and SPRINT keeps 7; a
    baseline with no block left for the backbone is refused in one line."""
    assert blocks(["arm=sprint75", "model.depth=6"]) == blocks(["arm=mask0", "model.depth=6"]) == 7
    with pytest.raises(ConfigError, match="leave no backbone block"):
        load_config(["arm=sprint75", "model=tiny", "model.depth=1"])


@pytest.mark.parametrize("model", ["micro_s", "tiny"])
def test_resplitting_arms_are_the_baselines_size(model):
    """Within ±5% of mask0's parameters on both presets; a test that fails if SPRINT went back to adding blocks
    (+46% on tiny) or MaskDiT to a full-width decoder on top of the backbone (+22%)."""
    sizes = arm_sizes(model, arms=RESPLIT_ARMS)
    assert [size.arm for size in sizes if not size.within] == []
    assert all(abs(size.change) <= SIZE_TOLERANCE for size in sizes)


def test_arms_sizes_lists_every_arm_beside_the_baseline(capsys):
    """`maskbench arms --sizes tiny` prints one line per shipped arm with its count and its change from mask0's;
    an arm that cannot run on the model says why instead of a number."""
    assert main(["arms", "--sizes", "tiny"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"^mask0 +{params_of(['arm=mask0', 'model=tiny']):,} +\+0\.0%  pairs$", out, re.M)
    assert "lsc_convert" in out and "not sized: " in out and "init_from" in out
    assert out.count("\n") == 1 + len(known_arms())
