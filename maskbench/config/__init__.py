"""Run configuration, one module per job: `schema` (what a config is), `compose` (building one from the
packaged YAML and the command line), `validate` (what makes one runnable) and `identity` (what names a run).

The names below are the package's API and the one path the rest of maskbench imports them by
(`from maskbench.config import load_config`); the modules are where each is defined.
"""

from maskbench.config.compose import (
                                      arm_settings,
                                      fill_eval_weights,
                                      known_arms,
                                      load_config,
                                      load_run_config,
                                      shipped_arm,
                                      with_eval_overrides,
)
from maskbench.config.identity import (
                                      DRAW_SCHEME,
                                      config_hash,
                                      data_label,
                                      format_arm,
                                      run_id,
                                      source_label,
                                      split_source,
                                      to_dict,
)
from maskbench.config.schema import (
                                      CONF_DIR,
                                      CONFIG_GROUPS,
                                      ArmConfig,
                                      AttentionKernel,
                                      BudgetConfig,
                                      DataConfig,
                                      DemoteGate,
                                      DemoteWindow,
                                      EvalConfig,
                                      InitWeights,
                                      LRSchedule,
                                      MixSource,
                                      PathsConfig,
                                      Phase,
                                      Precision,
                                      RunConfig,
                                      Tracker,
                                      Trainable,
                                      TrainConfig,
                                      Until,
                                      demote_routes,
)
from maskbench.config.validate import check_tracker, validate

__all__ = [
    "arm_settings", "fill_eval_weights", "known_arms", "load_config", "load_run_config", "shipped_arm",
    "with_eval_overrides", "DRAW_SCHEME", "config_hash", "data_label", "format_arm", "run_id", "source_label", "split_source",
    "to_dict", "CONF_DIR", "CONFIG_GROUPS", "ArmConfig", "AttentionKernel", "BudgetConfig", "DataConfig", "DemoteGate",
    "DemoteWindow", "EvalConfig", "InitWeights", "LRSchedule", "MixSource", "PathsConfig", "Phase", "Precision",
    "RunConfig", "Tracker", "Trainable", "TrainConfig", "Until", "demote_routes", "check_tracker", "validate",
]
