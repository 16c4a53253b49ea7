"""The metrics a run is scored on, each defined once.

A metric is a result key of the evaluator, a leaderboard column (with its sampling error beside it in
`<name>_se`), a direction (lower or higher is better), a label in tables and plots, and whether the
leaderboard statistics summarise and compare it. The leaderboard's columns, the statistics' metric list,
the summary tables' columns, the study page's curves, `repro`'s checks and the command line read `METRICS`,
so a new metric is one entry here and the code that measures it: an image metric's scorer in
`maskbench/eval/scorers.py`, returned by `eval.evaluate.image_scorers` for the data it applies to.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    """One metric; `name` is both the evaluator's result key and the leaderboard column."""

    name: str
    label: str                 # in tables and plots
    lower_is_better: bool
    produced_by: str           # what the evaluator computes it from
    compared: bool = True      # summarised over seeds and compared with the baseline by the statistics
    features: str | None = None  # the summary field naming the feature space it is measured in (FD: which network)
    log_axis: bool = False     # plotted on a log axis: it falls over orders of magnitude while training
    sample_count: str | None = "fid_n"  # the column counting the samples it was scored on (None: not recorded)

    @property
    def se_column(self) -> str:
        """The column of the metric's own sampling error (how far another draw of eval samples moves it)."""
        return f"{self.name}_se"


# The statistics' order (their CSV columns follow it); FD-DINOv2 is recorded but not yet compared.
METRICS: tuple[Metric, ...] = (
    Metric("fid", "FD", True, "Fréchet distance of the samples' features to the reference statistics, in the "
           "space `fid_features` names (Inception; the oracle's on synth); bootstrap SD over samples",
           features="fid_features"),
    Metric("clip_score", "CLIP", False, "CLIP cosine of each sample with its prompt; bootstrap SD over samples"),
    Metric("val_loss", "val loss", True, "fixed-t validation loss over held-out samples; standard error",
           log_axis=True, sample_count=None),  # the held-out set's size is not a row column
    Metric("align_acc", "align", False, "fraction of samples the synth oracle finds matching their scene; "
           "binomial standard error"),
    Metric("fd_dinov2", "FD-DINOv2", True, "Fréchet distance in DINOv2 features (`fd_dinov2_features`); "
           "bootstrap SD over samples", compared=False),
)
CO_PRIMARY = ("fid", "val_loss")  # FD and validation loss: every verdict table shows both


def get_metric(name: str) -> Metric:
    """The metric called `name`; an unknown name is refused, naming the known ones."""
    found = {m.name: m for m in METRICS}
    if name not in found:
        raise ValueError(f"unknown metric {name!r}; choose from {', '.join(found)}")
    return found[name]


def compared_metrics() -> tuple[str, ...]:
    """The names of the metrics the leaderboard statistics summarise and compare, in registry order."""
    return tuple(m.name for m in METRICS if m.compared)
