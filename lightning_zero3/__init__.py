"""lightning_zero3: ZeRO stage 3 as a PyTorch Lightning strategy.

``import lightning_zero3`` registers the strategy name ``"zero3"`` with Lightning (``lightning.pytorch``,
and ``pytorch_lightning`` when that package is installed, and Fabric), so ``Trainer(strategy="zero3")``
and ``Fabric(strategy="zero3")`` work.
"""

from .checkpoint import CheckpointError, CheckpointMismatchError, NonFiniteCheckpointError
from .config.settings import Zero3Config
from .engine import (
    ExecutionOrderError,
    NoTrainableParametersError,
    OptimizerShardingError,
    ParameterNotGatheredError,
    Zero3Engine,
    close_process_groups,
    engine_of,
    gathered_parameters,
    unshard,
)
from .engine.offload import NvmePathError, SwapDiskFullError
from .engine.plan import NothingFitsError, StepOverBudgetError
from .engine.schedule.hooks import RequiresGradChangedError
from .errors import UnsupportedPrecisionError, Zero3ConfigError
from .export.full_weights import save_full_weights
from .frontends.fabric.strategy import Zero3FabricPrecision, Zero3FabricStrategy
from .frontends.registration import register_strategies
from .frontends.trainer.precision import Zero3Precision
from .frontends.trainer.strategy import Zero3Strategy
from .pretrained import PeerLoadError, from_pretrained, load_pretrained

__version__ = "0.1.0"

register_strategies()

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "ExecutionOrderError",
    "NoTrainableParametersError",
    "NonFiniteCheckpointError",
    "NothingFitsError",
    "NvmePathError",
    "OptimizerShardingError",
    "ParameterNotGatheredError",
    "PeerLoadError",
    "RequiresGradChangedError",
    "StepOverBudgetError",
    "SwapDiskFullError",
    "UnsupportedPrecisionError",
    "Zero3Config",
    "Zero3ConfigError",
    "Zero3Engine",
    "Zero3FabricPrecision",
    "Zero3FabricStrategy",
    "Zero3Precision",
    "Zero3Strategy",
    "close_process_groups",
    "engine_of",
    "from_pretrained",
    "gathered_parameters",
    "load_pretrained",
    "save_full_weights",
    "unshard",
]
