"""What both front doors share (``Zero3Strategy`` for the Trainer, ``Zero3FabricStrategy`` for Fabric):
starting this job's processes on torch.distributed, watching them, and building the engine.

Each door keeps only what its framework asks for; ``ProcessesMixin`` expects the attributes both
Lightning strategy bases have (``cluster_environment``, ``parallel_devices``, ``node_rank``,
``local_rank``, ``global_rank``) and the door's own ``config``, ``_engine`` and ``_num_nodes``, and
answers what both frameworks look up on a distributed strategy.
"""

from __future__ import annotations

import inspect
import itertools
import sys
from typing import Any, Callable, Optional

import torch
import torch.distributed
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningModule
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import nn

from ..config.settings import Zero3Config, default_nvme_path
from .cpu_threads import gather_core_sets, ranks_sharing, threads_per_rank
from ..engine import Communicator, Zero3Engine
from ..engine.comm.collective_log import collective
from ..engine.failure.process_exit import close_process_groups_at_exit, note_failure
from ..engine.failure.watchdog import Watchdog
from ..engine.layout.materialize import parameters_on_meta
from ..engine.layout.slots import DtypePolicy
from ..engine.memory.buffers import map_large_temporaries

# One watchdog per run; every rank starts the same number of them, so their store keys agree.
_WATCHDOG_GENERATIONS = itertools.count()


def _one_process(group: Optional[Any] = None) -> bool:
    """Whether ``group`` (the job's, by default) has one process, or there is no process group at all:
    [Note: one process syncs nothing]."""
    return not _distributed_is_initialized() or torch.distributed.get_world_size(group) == 1


class ProcessesMixin:
    """Process group, CPU thread budget and watchdog for a zero3 strategy (either door)."""

    config: Zero3Config
    _engine: Optional[Zero3Engine]

    def _init_processes(self) -> None:
        self._process_group_backend: Optional[str] = self.config.process_group_backend
        self._failed = False
        # ranks of this job on this rank's cores, itself included (CPU only, set in _start_processes)
        self.ranks_sharing_cores: Optional[int] = None
        self._watchdog: Optional[Watchdog] = None

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    # -- what both frameworks look up on a distributed strategy ---------------------------------------

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def engine(self) -> Optional[Zero3Engine]:
        """The engine sharding the model, once ``setup`` has run."""
        return self._engine

    # -- collectives for the framework (logging with sync_dist, early stopping, fabric.all_reduce) -------
    #
    # [Note: one process syncs nothing]
    # Lightning reduces a value logged with ``sync_dist=True`` with a barrier and then an all-reduce, every
    # step. With one process both are identities, but under NCCL the barrier still waits until the GPU
    # has run everything queued: a training step that logs its loss stalls the host mid-step, and the GPU
    # can then idle while backward's first kernels are launched (a plain single-device run has no process
    # group and skips both). So a group of one process reduces and waits for nothing; the result is the
    # value itself, as the all-reduce of one process would leave it, for every op (a mean over one is it).

    def _reduce_tensor(self, tensor: Any, group: Optional[Any] = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor) and not _one_process(group):
            with collective("world", "reduce (`self.log(..., sync_dist=True)` or `strategy.reduce`)"):
                return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if _one_process():
            return
        with collective("world", "barrier", args[0] if args and isinstance(args[0], str) else kwargs.get("name")):
            if torch.distributed.get_backend() == "nccl":
                torch.distributed.barrier(device_ids=[self.root_device.index])
            else:
                torch.distributed.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        holder = [obj]
        with collective("world", f"broadcast from rank {src}"):
            torch.distributed.broadcast_object_list(holder, src, group=_group.WORLD)
        return holder[0]

    def _start_processes(self) -> None:
        """Join the job's process group (Lightning's launcher or torchrun / SLURM started the processes)."""
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=self.config.timeout, device_id=device_id
        )
        close_process_groups_at_exit()  # see [Note: process groups closed at exit] in engine/failure/process_exit.py
        if self.root_device.type == "cpu":
            # needs the process group: see [Note: the CPU thread budget] in frontends/cpu_threads.py
            mine, everyone = gather_core_sets()
            self.ranks_sharing_cores = ranks_sharing(mine, everyone)
            torch.set_num_threads(self.config.cpu_threads or threads_per_rank(mine, self.ranks_sharing_cores))
        self._start_watchdog()

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        self._set_rank_zero_only(self.global_rank)

    def _set_rank_zero_only(self, rank: int) -> None:
        utils_rank_zero_only.rank = rank

    def _start_watchdog(self) -> None:
        """See ``engine/failure/watchdog.py``: a failure on one rank ends every rank, with a message."""
        if self._watchdog is not None or torch.distributed.get_world_size() < 2:
            return
        config = self.config
        self._watchdog = Watchdog.for_default_group(
            config.timeout, next(_WATCHDOG_GENERATIONS), config.hang_timeout, config.hang_idle_timeout
        )
        self._watchdog.add_cleanup(lambda: self._engine.remove_swap_files() if self._engine is not None else None)
        self._watchdog.start()

    def _stop_watchdog(self) -> None:
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.stop()

    def _note_exception(self, exception: BaseException) -> None:
        """This rank failed: say so to the watchdog (the other ranks end too), naming the likelier cause."""
        self._failed = True
        note_failure()
        if self._watchdog is not None:
            # a peer that failed first, or is gone, is the likelier cause of this rank's error: say so
            reason = self._watchdog.fail(f"{type(exception).__name__}: {exception}")
            if reason is not None:
                print(f"zero3: rank {self.global_rank} stops because {reason}.", file=sys.stderr, flush=True)

    def _drop_engine_after_failure(self) -> None:
        """After an exception other ranks may be gone, so no collective may run: unhook and leave the
        weights sharded; swap files go (no collective involved)."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.hooks.remove()
            engine.release_offload()


#: The strategy names zero3 registers, the same for the Trainer and Fabric: (name, description, settings).
STRATEGY_NAMES = (
    ("zero3", "ZeRO stage 3: parameters, gradients and optimizer states sharded across ranks", {}),
    ("zero3_offload", "ZeRO stage 3 with optimizer state and parameter shards offloaded to host memory",
     {"offload_optimizer": "cpu", "offload_params": "cpu"}),
    ("zero3_offload_nvme", "ZeRO stage 3 with optimizer state and parameter shards swapped to NVMe files",
     {"offload_optimizer": "nvme", "offload_params": "nvme", "nvme_path": None}),
)  # fmt: skip


def register_names(strategy_cls: type, registry: Any) -> None:
    """``strategy_cls`` under each of ``STRATEGY_NAMES`` in a Lightning strategy registry (the Trainer's or
    Fabric's); the NVMe preset swaps under the system's temp directory (``default_nvme_path``)."""
    for name, description, settings in STRATEGY_NAMES:
        if "nvme_path" in settings:
            settings = {**settings, "nvme_path": default_nvme_path()}
        registry.register(name, strategy_cls, description=description, **settings)


def init_hook(module: nn.Module) -> Optional[Callable[[nn.Module], None]]:
    """The module's ``init_weights(module)``, the custom init for modules built on the meta device whose
    construction did not set their parameters (see [Note: eager construction replayed] in engine/layout/materialize.py).

    A LightningModule's must take the module (the Trainer's convention: a wrong signature is an error). A
    plain model under Fabric may have an ``init_weights`` of its own meaning: Hugging Face's ``init_weights()``
    initialises the whole model, which zero3 already does module by module through ``_init_weights``; so
    there only a one-argument ``init_weights`` is taken as the hook."""
    hook = getattr(module, "init_weights", None)
    if hook is None:
        return None
    try:
        inspect.signature(hook).bind(module)
    except (TypeError, ValueError):
        if not _is_lightning_module(module):
            return None
        raise TypeError(
            f"zero3: `{type(module).__name__}.init_weights` must take one argument, the module to initialise "
            "(it is called for every module built on the meta device, after its reset_parameters())."
        ) from None
    return hook


def _is_lightning_module(module: nn.Module) -> bool:
    """A LightningModule of either Lightning: ``pytorch_lightning``'s is a class of its own (see [Note: two
    Lightnings] in frontends/registration.py), checked only where that package was imported."""
    if isinstance(module, LightningModule):
        return True
    other = sys.modules.get("pytorch_lightning")
    return other is not None and isinstance(module, other.LightningModule)


def built_on_meta(config: Zero3Config, device: torch.device):
    """``parameters_on_meta()``, with the heap policy of a run sized by its host memory set first.

    A model built on the meta device still draws its random numbers on scratch tensors freed at once (see
    [Note: eager construction replayed] in engine/layout/materialize.py), and glibc's heap keeps their
    freed space resident before any weight is placed: a floor under the whole run's peak that no offload
    plan could lower. A run that offloads on the host (or may: ``"auto"``) maps its large temporaries from
    the start ([Note: large temporaries are mapped] in engine/memory/buffers.py), so that construction
    gives them back."""
    if device.type == "cpu" and config.offload_optimizer is not None:
        map_large_temporaries()
    return parameters_on_meta()


def new_engine(module: nn.Module, config: Zero3Config, device: torch.device, dtypes: DtypePolicy,
               ranks_per_node: int, activations=None) -> Zero3Engine:  # fmt: skip
    """Shard ``module`` (Lightning numbers ranks node by node: ``ranks_per_node`` consecutive ranks per node).
    ``activations``: a training step's, for the automatic offload plan (trainer/auto_plan.py)."""
    comm = Communicator(ranks_per_node=ranks_per_node)
    return Zero3Engine(module, config, comm, device, dtypes, init_hook(module), activations)


def refuse_untrainable(module: nn.Module, action: str) -> None:
    """Training asked of a model with no trainable parameter: fail before anything is built."""
    from ..engine import NoTrainableParametersError

    if not any(p.requires_grad for p in module.parameters()):
        raise NoTrainableParametersError(
            "zero3: the model has no trainable parameters (every parameter has requires_grad=False), so "
            f"there is nothing to train. Unfreeze at least one parameter, or {action}."
        )
