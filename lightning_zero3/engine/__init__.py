"""ZeRO stage 3, Lightning-free. See ``engine.py`` for the entry point and ``../../README.md`` for the picture."""

from .comm import Communicator
from .engine import NoTrainableParametersError, Zero3Engine, engine_of, gathered_parameters, unshard
from .optim import OptimizerShardingError
from .released import ParameterNotGatheredError
from .agreement import ExecutionOrderError
from .process_exit import close_process_groups

__all__ = [
    "Communicator",
    "ExecutionOrderError",
    "NoTrainableParametersError",
    "OptimizerShardingError",
    "ParameterNotGatheredError",
    "Zero3Engine",
    "close_process_groups",
    "engine_of",
    "gathered_parameters",
    "unshard",
]
