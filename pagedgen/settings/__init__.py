"""Every setting of a run, in one table (table.py), and the checked config built from it
(config.py). A leaf of the package: torch-free, importable from every layer."""
from pagedgen.settings.config import (EngineConfig, SettingError, check_combination,
                                      check_step_budget, checked)
from pagedgen.settings.table import (ALIASES, ENGINE, INPUT_OUTPUT, LLM_SETTINGS, MODEL, SETTINGS,
                                     TABLE, Setting, default, did_you_mean, for_command,
                                     outputs_identity)

__all__ = ["ALIASES", "ENGINE", "INPUT_OUTPUT", "LLM_SETTINGS", "MODEL", "SETTINGS", "TABLE",
           "EngineConfig", "Setting", "SettingError", "check_combination", "check_step_budget",
           "checked", "default", "did_you_mean", "for_command", "outputs_identity"]
