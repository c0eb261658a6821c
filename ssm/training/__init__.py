"""Training glue (needs pytorch_lightning): config schema, data modules, the LightningModule and
the run driver. The model itself (ssm.models.MambaLM) runs without any of it."""

from .config import ConfigError, TrainConfig, load_config
from .data import TASKS, TaskDataModule
from .module import LanguageModelTask, parameter_groups
from .run import RunResult, train

__all__ = ["TrainConfig", "ConfigError", "load_config", "TaskDataModule", "TASKS", "LanguageModelTask",
           "parameter_groups", "train", "RunResult"]
