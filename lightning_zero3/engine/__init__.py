"""ZeRO stage 3, Lightning-free. See ``engine.py`` for the entry point and ``docs/design.md`` for the picture.

The folders are layers in the order data flows; each imports only those before it:

    memory/    buffers, the byte ledger, parked pages                 (imports nothing of the engine)
    comm/      collectives, their timing, order checks, what each rank waits in (imports nothing of the engine)
    failure/   the watchdog, hang check, SIGTERM and exit: every rank ends with a message -> comm
    layout/    units, parameter slots, meta-device init, sources       -> memory
    offload/   master / gradient / optimizer state in host memory or on NVMe -> memory
    shard/     a unit's flat group, how it is gathered, secondary shards -> memory, comm, layout, offload
    grads/     gradient arrival and reduction, clipping, the sharded optimizer -> ... shard
    schedule/  execution order, prefetch, the hooks, inference residency -> ... grads
    state/     optimizer state full <-> sharded, loading sources into shards -> ... grads
    plan/      will it fit: per-rank bytes of each offload plan, the automatic plan -> memory, layout

On top: ``engine.py`` (``Zero3Engine``, with its optimizer side in ``optimizers.py``) and ``scaler.py``.
Nothing here imports Lightning; above the engine only the package's ``config`` and ``errors`` are imported.
"""

from ..errors import OptimizerShardingError
from .comm.agreement import ExecutionOrderError
from .comm.communicator import Communicator
from .failure.process_exit import close_process_groups
from .engine import NoTrainableParametersError, Zero3Engine, engine_of, gathered_parameters, unshard
from .layout.released import ParameterNotGatheredError

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
