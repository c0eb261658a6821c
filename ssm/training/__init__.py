"""Training glue: config schema, data modules, the LightningModule and the run driver (run.py),
with what a resume may change and the run directory's files (resume.py).

It needs the ``train`` extras (pytorch-lightning, pyyaml, matplotlib):
``pip install -e ".[train]"``, or ``make train``, which installs them. The model itself
(ssm.models.MambaLM), the layers and the scans run without any of them.
"""

from ._optional import require

require("pytorch_lightning", "ssm.training")
require("yaml", "ssm.training")

from .checkpoint import CheckpointError, load_checkpoint  # noqa: E402
from .config import ConfigError, TrainConfig, load_config  # noqa: E402
from .data import TASKS, TaskDataModule  # noqa: E402
from .module import LanguageModelTask, parameter_groups  # noqa: E402
from .run import RunResult, train  # noqa: E402

__all__ = [
    "TrainConfig",
    "ConfigError",
    "CheckpointError",
    "load_config",
    "load_checkpoint",
    "TaskDataModule",
    "TASKS",
    "LanguageModelTask",
    "parameter_groups",
    "train",
    "RunResult",
]
