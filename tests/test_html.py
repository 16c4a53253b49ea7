"""Pictures a person can read: sample grids enlarged with their prompts, and the self-contained study page
(`maskbench leaderboard --html`) whose every table, curve and grid is checked by parsing it back."""

import base64
import io
from html import escape
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from maskbench.cli import main
from maskbench.eval.evaluate import save_samples
from maskbench.eval.grid import GRID_FILE, INK, PAD, prompt_grid, upscale_factor
from maskbench.results.rows import append_rows
from maskbench.train.checkpoint import RunDir

CAPTIONS = ["a large red circle at the top left and a small blue square at the bottom right",
            "a small green triangle at the centre", "", "ünïcödé … prompt", "x" * 300]


def samples(n: int, side: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (n, side, side, 3), dtype=np.uint8)     # N×H×W×3


def test_grid_holds_each_sample_enlarged_pixel_for_pixel_with_its_prompt_under_it():
    images, n_cols, side = samples(5, 16), 3, 16
    scale = upscale_factor(side)
    tile = side * scale
    grid = np.asarray(prompt_grid(images, CAPTIONS, n_cols=n_cols))                        # H'×W'×3
    assert scale == 8 and grid.shape[1] >= n_cols * tile
    row_h = (grid.shape[0] - PAD) // 2                                                     # 5 tiles in 2 rows
    for i, image in enumerate(images):
        x, y = PAD + (i % n_cols) * (tile + PAD), PAD + (i // n_cols) * row_h
        enlarged = image.repeat(scale, axis=0).repeat(scale, axis=1)                      # tile×tile×3
        np.testing.assert_array_equal(grid[y:y + tile, x:x + tile], enlarged)
        caption_area = grid[y + tile:y + row_h - PAD, x:x + tile]
        assert (caption_area == INK).all(axis=-1).any() == bool(CAPTIONS[i])               # text where a prompt is


def test_save_samples_keeps_the_per_sample_pngs_and_writes_the_prompt_grid(tmp_path: Path):
    images = samples(6, 8)
    grid_path = save_samples(torch.from_numpy(images), CAPTIONS + ["one more"], tmp_path, grid_size=4)
    for i, image in enumerate(images):                                                     # what repro reads
        np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / f"{i:05d}.png")), image)
    assert grid_path == tmp_path / GRID_FILE
    np.testing.assert_array_equal(np.asarray(Image.open(grid_path)), np.asarray(prompt_grid(images[:4], CAPTIONS[:4])))


class Page(HTMLParser):
    """The tables (rows of cell texts, header first), every src/href, and the text of each <p class=missing>."""

    def __init__(self, text: str):
        super().__init__()
        self.tables, self.links, self.missing, self._in = [], [], [], None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.links += [attrs[key] for key in ("src", "href") if key in attrs]
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self.tables[-1][-1].append("")
            self._in = "cell"
        elif tag == "p" and attrs.get("class") == "missing":
            self.missing.append("")
            self._in = "missing"

    def handle_endtag(self, tag):
        if tag in ("td", "th", "p"):
            self._in = None

    def handle_data(self, data):
        if self._in == "cell":
            self.tables[-1][-1][-1] += data
        elif self._in == "missing":
            self.missing[-1] += data


def png_of(src: str) -> Image.Image:
    prefix = "data:image/png;base64,"
    assert src.startswith(prefix)
    image = Image.open(io.BytesIO(base64.b64decode(src[len(prefix):], validate=True)))
    assert image.format == "PNG"
    image.load()
    return image


@pytest.fixture
def study(tmp_path: Path) -> Path:
    """A study folder: mask0 and mask75, two seeds, two eval points, FD, val loss and alignment."""
    rows = []
    for arm, better in (("mask0", 1.0), ("mask75", 0.8)):
        for seed in (0, 1):
            for point in (0.5, 1.0):
                rows.append({"run_id": f"{arm}-synth-tiny-s{seed}-abc", "arm": arm, "dataset": "synth",
                             "model": "tiny", "batch_size": 8, "budget_flops": 1e12, "point": point, "seed": seed,
                             "train_flops": point * 1e12, "gpu_hours": point * better,
                             "fid": 100 * better / point + seed, "fid_features": "oracle-synth-v1",
                             "val_loss": 0.5 * better / point + 0.01 * seed,
                             "align_acc": 0.3 * point / better})
    append_rows(tmp_path / "mystudy" / "leaderboard.csv", rows)
    return tmp_path / "mystudy" / "leaderboard.csv"


def test_study_page_embeds_its_tables_curves_and_grids_and_names_the_missing_ones(tmp_path: Path, study: Path,
                                                                                   capsys):
    runs = tmp_path / "runs"
    grid = prompt_grid(samples(4, 8), CAPTIONS[:4])
    grid_path = RunDir(runs / "mask0-synth-tiny-s0-abc").point_samples(1.0) / GRID_FILE  # mask75's run dir: absent
    grid_path.parent.mkdir(parents=True)
    grid.save(grid_path)

    assert main(["leaderboard", str(study), "--html", str(tmp_path / "pages"), "--runs", str(runs)]) == 0
    page = Page((tmp_path / "pages" / "mystudy" / "report.html").read_text(encoding="utf-8"))

    images = [png_of(src) for src in page.links]                            # self-contained: every link a PNG
    assert len(images) == 2                                                 # one group's curves, one grid
    np.testing.assert_array_equal(np.asarray(images[1]), np.asarray(grid))
    summary, against = page.tables[0], page.tables[1]
    assert {row[summary[0].index("arm")] for row in summary[1:]} == {"mask0", "mask75"}
    assert [row[summary[0].index("point")] for row in summary[1:]] == ["0.5", "1", "0.5", "1"]
    assert {row[against[0].index("metric")] for row in against[1:]} == {"fid", "val_loss"}
    assert main(["leaderboard", str(study), "--format", "markdown"]) == 0  # the text report, cell for cell
    printed = capsys.readouterr().out.splitlines()
    for table in page.tables[:3]:                                          # values, comparisons, compute to target
        assert all("| " + " | ".join(row) + " |" in printed for row in table)
    assert page.tables[-1][0] == ["mask0 (seed 0, point 1)"]               # the grids present, side by side
    assert len(page.missing) == 1 and "mask75-synth-tiny-s0-abc" in page.missing[0]
    assert "mask0-synth-tiny-s0-abc" not in page.missing[0]


def test_html_refuses_the_reports_it_does_not_write(tmp_path: Path, study: Path, capsys):
    assert main(["leaderboard", str(study), "--html", str(tmp_path), "--mlperf"]) == 2
    assert "--html" in capsys.readouterr().err


PLAN = ("---\nstudy: curves\nwritten: 2026-01-01T00:00:00+00:00\nprimary_metrics: [fid, val_loss]\nbaseline: mask0\n"
        "targets: baseline horizons\ntest: paired t over seeds\nalpha: 0.05\ncorrection: holm\n"
        "pays:\n  ratio: compute multiplier\n  interval: above 1\n  metrics: all primary\n---\n# the plan\n")


@pytest.fixture
def curves_study(tmp_path: Path) -> Path:
    """mask0, mask75 (its curve's amplitude 0.22 against mask0's 0.30: M(B) 1.7, pays) and mask50 (0.40: M(B) 0.62,
    does not pay), 3 seeds, 4 horizons, val loss and FD with sampling errors, under a compute-multiplier plan;
    with mask0's ladder to 4 B in the same CSV (its exact curve), which M is read off."""
    rng = np.random.default_rng(0)
    rows = []
    ladder = ("mask0", 0.30, 4e12, (1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0), 0.0, "-ladder")  # mask0 to 4 B, exact
    for seed in range(3):
        jitter = 1 + 0.03 * rng.normal()
        for arm, amplitude, budget, points, noise, name in (
                *((arm, a, 1e12, (0.125, 0.25, 0.5, 1.0), 1.0, "") for arm, a in
                  (("mask0", 0.30), ("mask75", 0.22), ("mask50", 0.40))), ladder):
            for point in points:
                c = point * budget / 1e12
                loss = 0.05 + amplitude * jitter * c**-0.6
                rows.append({"run_id": f"{arm}-synth-tiny-s{seed}-abc{name}", "arm": arm, "dataset": "synth",
                             "model": "tiny", "batch_size": 8, "budget_flops": budget, "point": point, "seed": seed,
                             "train_flops": c * 1e12, "gpu_hours": c,
                             "val_loss": loss * (1 + noise * 0.003 * rng.normal()), "val_loss_se": 0.003 * loss,
                             "fid": 1000 * loss * (1 + noise * 0.01 * rng.normal()), "fid_se": 10 * loss,
                             "fid_n": 2048, "fid_features": "oracle-synth-v1",
                             "created_at": "2026-02-01T00:00:00+00:00"})
    append_rows(tmp_path / "curves" / "leaderboard.csv", rows)
    (tmp_path / "curves" / "PLAN.md").write_text(PLAN, encoding="utf-8")
    return tmp_path / "curves" / "leaderboard.csv"


def test_the_page_opens_with_a_headline_from_the_verdicts_and_shows_the_compute_curves(tmp_path: Path,
                                                                                       curves_study: Path, capsys):
    from maskbench.results.html import analyse
    from maskbench.results.tables import headline

    assert main(["leaderboard", str(curves_study), "--html", str(tmp_path / "pages"), "--runs", str(tmp_path)]) == 0
    text = (tmp_path / "pages" / "curves" / "report.html").read_text(encoding="utf-8")
    page = Page(text)
    expected = headline(analyse("curves", [str(curves_study)], None, None, "skip").verdicts)
    assert expected == ("By the plan's rule (confirmatory), on synth/tiny/b8/1e+12 at B = 1e+12 FLOPs: mask50 does not "
                        "pay, mask75 pays.")
    assert text.index(f"<p class=\"headline\">{escape(expected)}</p>") < text.index("<table")  # it opens the page
    assert len(page.links) == 3 and all(png_of(src).width > 400 for src in page.links)  # the fits; each group's curves (the study, the ladder)
    assert main(["leaderboard", str(curves_study), "--format", "markdown"]) == 0
    printed = capsys.readouterr().out.splitlines()
    headers = [table[0] for table in page.tables]
    for columns in (["arm", "E (95% CI)", "A (95% CI)", "α (95% CI)"], ["arm", "figure at B", "predicted (95% CI)",
                                                          "measured (95% CI)", "prediction"]):
        assert columns in headers
    verdicts = next(table for table in page.tables if table[0][:3] == ["group", "arm", "metric"])
    assert {row[1]: row[-2] for row in verdicts[1:]} == {"mask75": "pays", "mask50": "does not pay"}
    for table in page.tables:                                               # every table as the report prints it
        assert all("| " + " | ".join(row) + " |" in printed for row in table)


def test_a_study_without_compute_curves_still_opens_with_a_generated_headline(tmp_path: Path, study: Path):
    from maskbench.results.html import analyse
    from maskbench.results.tables import ratio_headline

    assert main(["leaderboard", str(study), "--html", str(tmp_path / "pages"), "--runs", str(tmp_path)]) == 0
    text = (tmp_path / "pages" / "mystudy" / "report.html").read_text(encoding="utf-8")
    found = analyse("mystudy", [str(study)], None, None, "skip")
    expected = ratio_headline(found.summary, found.family)
    assert expected.startswith("Without a plan (exploratory), on the FLOPs to reach mask0's value at its last horizon: "
                               "on synth/tiny/b8/1e+12: mask75 ")
    assert f"<p class=\"headline\">{escape(expected)}</p>" in text
    assert not found.fits and "<h2>Compute curves</h2>" not in text and "The plan's verdict" not in text
