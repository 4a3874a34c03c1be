"""``Zero3Engine``: ZeRO stage 3 over one module, with no Lightning in sight.

Plain torch can drive it (the engine tests do)::

    engine = Zero3Engine(model, Zero3Config())        # shards the model in place
    optimizer = torch.optim.AdamW(model.parameters())
    engine.shard_optimizer(optimizer)                  # the optimizer now steps this rank's shards
    loss = model(batch).sum(); loss.backward()         # gathers, releases and reduce-scatters on its own
    optimizer.step(); optimizer.zero_grad()            # shards stepped; gathered copies refreshed
    engine.close()                                     # model holds ordinary full tensors again

With ``offload_optimizer`` / ``offload_params`` set, masters, gradients and optimizer state live in host
memory or in swap files (``offload/``); ``engine.states_in_memory()`` makes them readable and writable.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from contextlib import contextmanager, nullcontext
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..config.settings import OffloadTier, Zero3Config, parse_budget
from .comm.agreement import OrderCheck
from .comm.communicator import Communicator
from .failure.process_exit import close_process_groups_at_exit
from .grads import gradients
from .grads.reduction import ReductionQueue
from .layout import sources
from .layout.materialize import InitFn, Materializer, has_meta_tensors
from .layout.slots import DtypePolicy, ParamSlot
from .layout.sources import TensorValue
from .layout.units import plan_units
from .memory import parking
from .memory.buffers import (
    GATHERED_PARAMS,
    BufferPool,
    ByteLedger,
    keep_heap_top,
    map_large_temporaries,
    resident_bytes,
    return_free_heap,
)
from .offload import Offload, PipelinedStep, restore_flags
from .optimizers import OptimizerSide
from .plan.dynamic import DynamicPlan, Level, StepMeter, ladder
from .plan.facts import Activations
from .plan.resolve import resolve_auto
from .schedule.hooks import HookManager
from .schedule.prefetch import Schedule
from .schedule.residency import Residency
from .shard.flat_group import FlatGroup
from .shard.runtime import UnitRuntime
from .shard.secondary import SecondaryShard, resolve_size
from .state.loading import load_sources

# Which engine manages a parameter is kept on the parameter itself (a weak reference under this
# attribute), so ``gathered_parameters(module)`` works from the module alone.
_ENGINE_ATTR = "_zero3_engine"
# The engine sharding a module, for as long as the module lives: a later Trainer (validate after fit,
# a second fit) finds it there and runs on the same shards. The module holds it (under this attribute, in
# an ``_EngineLink``), and the engine holds the module: a reference cycle, so both go together once the
# user drops the module (the garbage collector frees them). A weak-keyed table of module -> engine, as
# before, never let either go: its value, the engine, holds the key.
_LINK_ATTR = "_zero3_engine_link"


class _EngineLink:
    """A sharded module's reference to its engine. Deep copies and pickles of the module hold None in its
    place: the engine shards the module it was built on, never a copy."""

    __slots__ = ("engine",)

    def __init__(self, engine: "Zero3Engine") -> None:
        self.engine = engine

    def __deepcopy__(self, memo: dict) -> None:
        return None

    def __reduce__(self) -> tuple:
        return (type(None), ())


def engine_of(module: nn.Module) -> Optional["Zero3Engine"]:
    """The engine that shards ``module`` (None if it is not sharded)."""
    link = module.__dict__.get(_LINK_ATTR)
    return link.engine if link is not None else None


def owning_engine(module: nn.Module) -> Optional["Zero3Engine"]:
    """The engine that shards ``module`` or the model ``module`` is part of (None if neither is sharded)."""
    engine = engine_of(module)
    if engine is not None:
        return engine
    for p in module.parameters():
        ref = getattr(p, _ENGINE_ATTR, None)
        if ref is not None and ref() is not None:
            return ref()
    return None


class NoTrainableParametersError(ValueError):
    """Training was asked of a model whose parameters all have ``requires_grad=False``."""


#: the settings the automatic offload plan decides or sizes (see plan/choose.py)
def _build_device(module: nn.Module, device: Optional[torch.device], meta: bool) -> torch.device:
    """Where the shards are built: ``device``, else where the model's parameters are (CPU if it has none)."""
    if device is None and meta:
        raise ValueError("zero3: the model is on the meta device; pass `device=` to build its shards on.")
    first = next(module.parameters(), None)
    return device or (first.device if first is not None else torch.device("cpu"))


AUTO_SETTINGS = ("offload_optimizer", "offload_params", "offload_buffer_count", "prefetch_bucket_size", "memory_budget")


class Zero3Engine(OptimizerSide):
    def __init__(
        self,
        module: nn.Module,
        config: Optional[Zero3Config] = None,
        comm: Optional[Communicator] = None,
        device: Optional[torch.device] = None,
        dtypes: DtypePolicy = DtypePolicy(),
        init_fn: Optional[InitFn] = None,
        activations: Optional[Activations] = None,
    ) -> None:
        """Shard ``module`` in place. Parameters on the meta device are materialised unit by unit, straight
        into shards (see [Note: sharded initialisation] in engine/layout/materialize.py): rank 0 replays what their
        construction under ``parameters_on_meta()`` did, else each module's ``reset_parameters()`` and then
        ``init_fn(module)`` initialise them. ``activations``: what one training step saves for backward, for the
        automatic offload plan (see plan/resolve.py; the caller measures them on the meta device)."""
        self.module = module
        self.config = config or Zero3Config()
        self.dtypes = dtypes
        self.comm = comm or Communicator()
        if self.comm.distributed:
            close_process_groups_at_exit()  # see [Note: process groups closed at exit] in engine/failure/process_exit.py
        self.ledger = ByteLedger()
        self.pool = BufferPool(self.ledger)  # staging buffers, see [Note: reused staging buffers] in memory/buffers.py
        meta = has_meta_tensors(module)
        self.device = _build_device(module, device, meta)
        self._take_offload_plan(activations)  # before any weight is placed: nothing to undo if no plan fits
        self._set_heap_policy()
        # values a checkpoint will supply (load_pretrained on the meta model): see [Note: loading straight
        # into shards] in engine/layout/sources.py
        pending = sources.take(module)
        materializer = (
            Materializer(module, self.device, init_fn, self.comm.rank == 0, pending.params, pending.buffers)
            if meta else None
        )  # fmt: skip
        if self.config.sync_module_states or meta:
            self._broadcast_buffers()
        self._plan_units()
        self.offload = self._start_offload()
        self._build_groups(materializer, pending)
        if materializer is not None:
            materializer.check_done(module)
        self._index_slots()
        if pending:
            load_sources(self, pending)
        self._route_gathers(self.config)
        self._build_schedule()
        module.__dict__[_LINK_ATTR] = _EngineLink(self)
        if self.offload is not None:
            self.offload.plan_host_pool([rt.group.shard_numel * rt.group.shard.element_size() for rt in self.runtimes])
        self.set_trim_between_phases(self.plan_estimate is not None and self.plan_estimate.trim_between_phases)
        self.dynamic_plan = self._dynamic_plan()
        self.optimizers: list[torch.optim.Optimizer] = []
        self._step_handles: list = []
        self._offloaded_steps: list[tuple[PipelinedStep, list[dict]]] = []

    # -- construction, step by step (in the order ``__init__`` runs them) ------------------------------

    def _take_offload_plan(self, activations: Optional[Activations]) -> None:
        """``offload_*="auto"``: the plan chosen from the estimate replaces ``"auto"`` in ``self.config``."""
        self.plan_choice: Optional[str] = None  # why the automatic offload plan was taken (plan/resolve.py)
        self.plan_estimate = None  # its figures (``PlanEstimate``), and the settings it was chosen from:
        self.auto_settings: Optional[dict] = None  # the "auto" ones, for a later run's reuse_problems
        self.plan_budget: Optional[int] = None  # bytes per rank the plan was chosen to fit
        if "auto" not in (self.config.offload_optimizer, self.config.offload_params):
            return
        first = next(self.module.parameters(), None)
        master = first.element_size() if first is not None else 4
        compute = torch.tensor([], dtype=self.dtypes.compute).element_size() if self.dtypes.compute else master
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or self.comm.world_size
        self.auto_settings = {name: getattr(self.config, name) for name in AUTO_SETTINGS}
        self.config, self.plan_estimate, self.plan_choice, self.plan_budget = resolve_auto(
            self.module, self.config, self.comm.world_size, local, self.device, master, compute, activations
        )

    def _dynamic_plan(self, state: Optional[dict] = None) -> Optional[DynamicPlan]:
        """An automatic plan holds its budget while training too (see [Note: the plan at step boundaries]);
        ``state``: an earlier one's (``DynamicPlan.state_dict``), whose level it takes."""
        if self.plan_budget is None:
            return None

        def take(level: Level) -> None:
            self.schedule.prefetch_numel = level.prefetch_numel
            self.set_trim_between_phases(level.trim_between_phases)

        def all_reduce_max(figures: torch.Tensor) -> torch.Tensor:
            return self.comm.all_reduce(figures.to(self.device), dist.ReduceOp.MAX).cpu()

        levels = ladder(self.config.prefetch_bucket_size, self.plan_estimate.trim_between_phases)
        estimate = self.plan_estimate.device_bytes_per_rank if state is None else None
        plan = DynamicPlan(self.plan_budget, levels, StepMeter(self.device), take, all_reduce_max, estimate)
        if state is not None:
            plan.load_state_dict(state)
        return plan

    def _set_heap_policy(self) -> None:
        # a run sized by its host memory: its states are offloaded to host memory or NVMe of a CPU run
        self.host_sized = self.device.type == "cpu" and self.config.offload_optimizer is not None
        if self.host_sized:
            map_large_temporaries()  # [Note: large temporaries are mapped] in memory/buffers.py
        elif self.device.type == "cpu":
            keep_heap_top()  # [Note: the heap keeps its top between steps] in memory/buffers.py

    def _plan_units(self) -> None:
        """The units, and the process groups their collectives run in (tuned before any unit exists)."""
        self.plan = plan_units(self.module, self.config.unit_modules, self.config.persistence_threshold)
        self.comm.open_side_groups(self.config.timeout)  # see [Note: three process groups] in comm/communicator.py
        self.secondary_size: Optional[int] = None  # the groups secondary shards are kept in (shard/secondary.py)
        resolve_size(self.config.secondary_shard_size, self.comm)  # a bad value fails before any unit is built
        if self.config.tune_collectives:
            # before any group exists: the tuning buffers are not stacked on top of the shards
            self.comm.tune(_collective_sizes(self.plan, self.dtypes, self.comm.world_size), self.device)

    def _build_groups(self, materializer: Optional[Materializer], pending) -> None:
        """Every unit's flat group, one after the other (one unit in full at a time), then the persistent one."""
        sync = self.config.sync_module_states
        # [Note: one process keeps its units gathered] in shard/flat_group.py
        alone = self.comm.world_size == 1 and not self.config.single_process_sharding
        stays = alone and self.config.offload_params is None
        self.root: Optional[UnitRuntime] = None  # the root unit, if it owns sharded parameters
        self.unit_runtimes: list[tuple[nn.Module, UnitRuntime]] = []  # every other unit, in module order
        for spec in self.plan.units:
            if spec.params:
                name = spec.path or "<root>"
                group = FlatGroup(
                    name, spec.params, self.comm, self.ledger, self.pool, self.device, False, sync, self.dtypes,
                    materializer=materializer, offload=self.offload, loaded=pending.params, stays_gathered=stays,
                )
                runtime = UnitRuntime(name, group, self.comm)
                runtime.maybe_release()  # before the next unit is built: one unit in full at a time
                parking.flush()  # the next unit is a new buffer, not a gather: no pages kept for it (memory/parking.py)
                if spec is self.plan.root:
                    self.root = runtime
                else:
                    self.unit_runtimes.append((spec.module, runtime))
        self.persistent: Optional[UnitRuntime] = None
        if self.plan.persistent:
            group = FlatGroup(
                "<persistent>", self.plan.persistent, self.comm, self.ledger, self.pool, self.device, True, sync,
                self.dtypes, materializer=materializer, offload=self.offload, loaded=pending.params,
                stays_gathered=stays,
            )
            self.persistent = UnitRuntime(group.name, group, self.comm)
        units = [rt for _, rt in self.unit_runtimes]
        self.runtimes = [rt for rt in [self.root, *units, self.persistent] if rt is not None]

    def _index_slots(self) -> None:
        """Each parameter's slot, found from the user's parameter or from its shard; parameters know their engine."""
        self.slots: dict[int, ParamSlot] = {}  # by id of the user's parameter
        self._slot_of_shard: dict[int, tuple[FlatGroup, ParamSlot]] = {}  # by id of the shard parameter
        for runtime in self.runtimes:
            for slot in runtime.group.slots:
                self.slots[id(slot.param)] = slot
                self._slot_of_shard[id(slot.shard_param)] = (runtime.group, slot)
                setattr(slot.param, _ENGINE_ATTR, weakref.ref(self))

    def _build_schedule(self) -> None:
        """The order check, the gather schedule, the reduction queue, inference residency and the hooks."""
        cfg = self.config
        units = [rt for _, rt in self.unit_runtimes]
        self.order_check = OrderCheck([rt.group for rt in self.runtimes], self.comm)
        for runtime in self.runtimes:
            runtime.group.check = self.order_check
        self.schedule = Schedule(
            units, self.order_check, cfg.prefetch_bucket_size, cfg.max_live_parameters, cfg.max_reuse_distance
        )
        queue = ReductionQueue(units, self.root, self.persistent, self.comm, cfg.reduce_bucket_size, cfg.overlap_comm)
        candidates = ([self.root] if self.root else []) + units
        self.residency = Residency(
            candidates, self.comm, self.ledger, cfg.inference_memory_budget,
            self.root.group.full.numel() * self.root.group.full.element_size() if self.root else 0,
            [rt.group.full.numel() * rt.group.full.element_size() for rt in units], self.schedule,
        )
        self.hooks = HookManager(
            self.module, self.root, self.unit_runtimes, self.persistent, self.schedule, queue,
            cfg.reduce_bucket_size, cfg.offload_buffer_count if cfg.offload_params == OffloadTier.NVME else 0,
            self.residency,
        )

    # -- one engine for the module's whole life -------------------------------------------------------

    #: settings that decide how the model is laid out in shards; a later Trainer must keep them
    LAYOUT = (
        "unit_modules", "persistence_threshold", "single_process_sharding", "offload_optimizer", "offload_params",
        "nvme_path",
    )  # fmt: skip

    def resolved(self, config: Zero3Config) -> Zero3Config:
        """``config`` of a later run on these shards, with the automatic plan this engine took in place of
        ``"auto"``: an offload setting ``"auto"`` takes the tier chosen, and the settings the plan sized
        (buffer count, prefetch) keep their sized values where the later run asks what this one asked."""
        if self.auto_settings is None or "auto" not in (config.offload_optimizer, config.offload_params):
            return config
        changes = {"memory_budget": None}
        for name, asked in self.auto_settings.items():
            value = getattr(config, name)
            if name != "memory_budget" and (value == "auto" or value == asked):
                changes[name] = getattr(self.config, name)
        return dataclasses.replace(config, **changes)

    def reuse_problems(self, config: Zero3Config, dtypes: DtypePolicy, device: torch.device, world_size: int) -> list[str]:
        """What keeps this engine from serving a later run with these settings (empty: it can)."""
        config = self.resolved(config)
        problems = [
            f"{name}={getattr(config, name)!r} (the model was sharded with {getattr(self.config, name)!r})"
            for name in self.LAYOUT
            if getattr(config, name) != getattr(self.config, name)
        ]
        if dtypes != self.dtypes:
            problems.append(f"the precision's dtypes {dtypes} (the model was sharded with {self.dtypes})")
        if torch.device(device) != self.device:
            problems.append(f"device {device} (the shards live on {self.device})")
        if world_size != self.comm.world_size:
            problems.append(f"{world_size} ranks (the model was sharded over {self.comm.world_size})")
        return problems

    def reconfigure(self, config: Zero3Config) -> None:
        """Take the scheduling settings of a later run (prefetch, buckets, overlap); the layout stays."""
        config = self.resolved(config)
        self.config = config
        self.schedule.prefetch_numel = config.prefetch_bucket_size
        self.schedule.max_live_numel = config.max_live_parameters
        self.schedule.max_reuse_distance = config.max_reuse_distance
        self.hooks.coalesce_below = config.reduce_bucket_size
        self.hooks.queue.bucket_numel = config.reduce_bucket_size
        self.hooks.queue.overlap = config.overlap_comm
        self.residency.setting = parse_budget(config.inference_memory_budget)
        self._route_gathers(config)
        if self.dynamic_plan is not None:  # the automatic plan's level in force stays (engine/plan/dynamic.py)
            self.dynamic_plan = self._dynamic_plan(self.dynamic_plan.state_dict())

    def _route_gathers(self, config: Zero3Config) -> None:
        """Secondary shards and int8 gathers as ``config`` asks (see [Note: gather routes] in engine/shard/gather.py);
        a change of ``secondary_shard_size`` between runs re-creates the groups (a collective)."""
        size = resolve_size(config.secondary_shard_size, self.comm)
        if size != self.secondary_size:
            for runtime in self.runtimes:
                runtime.group.drop_secondary()
                runtime.group.secondary = None
            self.comm.close_secondary_groups()
            self.comm.open_secondary_groups(size or 1, config.timeout)
            self.secondary_size = size
            for runtime in self.runtimes:
                group = runtime.group
                if size and not group.kept_whole:
                    index = self.comm.rank % size
                    group.secondary = SecondaryShard(
                        group.full.numel(), size, index, group.compute_dtype, self.device, self.ledger
                    )
        for runtime in self.runtimes:
            runtime.group.quantized = config.quantize_gathers == "int8" and not runtime.group.kept_whole

    def _start_offload(self) -> Optional[Offload]:
        """The offload tiers, after checking (NVMe) that the swap folder has room for every shard."""
        cfg = self.config
        if cfg.offload_optimizer is None:
            return None
        offload = Offload(cfg, self.ledger, self.device, self.comm.rank)
        world = self.comm.world_size
        planned = 0
        for params in [spec.params for spec in self.plan.units] + [self.plan.persistent]:
            numel = sum(p.numel() for _, p in params)
            if numel:
                copies = 2 if any(p.requires_grad for _, p in params) else 1  # master (+ gradient)
                planned += copies * -(-numel // world) * params[0][1].element_size()
        offload.check_room(planned, "the master and gradient shards")
        return offload

    @property
    def shard_params(self) -> list[nn.Parameter]:
        return [slot.shard_param for slot in self.slots.values()]

    # -- gradients (see grads/gradients.py) ---------------------------------------------------------------

    @property
    def _groups(self) -> list[FlatGroup]:
        return [rt.group for rt in self.runtimes]

    @property
    def _buffer_count(self) -> int:
        return self.config.offload_buffer_count

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, params=None) -> torch.Tensor:
        """Clip by the norm of the full gradients (a collective); ``params``: shard parameters (default all)."""
        return gradients.clip_grad_norm_(
            self._groups, gradients.ids(params), max_norm, self.comm, norm_type, self._buffer_count
        )

    def clip_grad_value_(self, clip_value: float, params=None) -> None:
        gradients.clamp_gradients(self._groups, gradients.ids(params), clip_value)

    def unscale_gradients_(self, inverse_scale: float, params=None) -> bool:
        """Multiply the gradients by ``inverse_scale``; True when any rank holds a non-finite gradient."""
        return gradients.unscale_gradients_(
            self._groups, gradients.ids(params), inverse_scale, self.comm, self._buffer_count
        )

    # -- full parameters on demand ----------------------------------------------------------------

    @contextmanager
    def gathered_parameters(self, module: Optional[nn.Module] = None, modifier_rank: Optional[int] = None) -> Iterator[None]:
        """Gather every unit that holds a parameter of ``module`` (default: the whole model).

        A collective: call it on every rank. With ``modifier_rank`` set, the full parameters of that rank
        are written back into the shards of all ranks when the block ends.
        """
        wanted = {id(p) for p in (module or self.module).parameters()}
        runtimes = [rt for rt in self.runtimes if any(id(s.param) in wanted for s in rt.group.slots)]
        for runtime in runtimes:
            runtime.context_holds += 1
            runtime.acquire()
        try:
            yield
        finally:
            with self._groups_in_memory([rt.group for rt in runtimes]) if modifier_rank is not None else nullcontext():
                for runtime in runtimes:
                    if modifier_rank is not None:
                        runtime.group.write_back(src=modifier_rank)
                    runtime.context_holds -= 1
                    runtime.maybe_release()
            return_free_heap()  # [Note: the heap between phases] in memory/buffers.py

    # -- full state dicts ---------------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """``module.state_dict()`` with full parameters in the master dtype (a collective; holds a full copy:
        for models that fit; ``lightning_zero3.save_full_weights`` streams them to a file instead)."""
        own = self.module.state_dict(keep_vars=True)  # keep_vars: no op touches the released parameters
        full: dict[int, torch.Tensor] = {}
        for runtime in self.runtimes:
            with runtime.group.gathered_master() as master:
                for slot in runtime.group.slots:
                    full[id(slot.param)] = master[slot.offset : slot.offset + slot.numel].view(slot.param.shape).clone()
        return {name: full[id(v)] if id(v) in full else v.detach().clone() for name, v in own.items()}

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load full (unsharded) weights: each rank keeps its slice, in the master dtype (under NVMe written
        straight to the swap files). Buffers are copied. ``state_dict`` may be memory-mapped from a file
        (``torch.load(..., mmap=True)``): each tensor's pages are dropped once its slice is taken."""
        own = self.module.state_dict(keep_vars=True)
        missing, unexpected = sorted(own.keys() - state_dict.keys()), sorted(state_dict.keys() - own.keys())
        if strict and (missing or unexpected):
            raise KeyError(f"zero3: state dict does not fit the model: missing {missing}, unexpected {unexpected}.")
        buffers = {id(b): (id(m), name) for m in self.module.modules() for name, b in m._buffers.items() if b is not None}
        values = sources.PendingValues()
        for name, value in state_dict.items():
            target = own.get(name)
            if target is None:
                continue
            source = TensorValue(value, f"the state dict's {name}")
            if id(target) in self.slots:
                values.params[id(target)] = source
            elif id(target) in buffers:
                values.buffers[buffers[id(target)]] = source
        load_sources(self, values)

    def refresh_gathered(self) -> None:
        """The shards changed under the model: secondary shards go, full copies alive right now are gathered anew."""
        for runtime in self.runtimes:
            runtime.group.drop_secondary()
            if runtime.group.gathered:
                runtime.group.gather(force=True)

    def group_of(self, shard_param: nn.Parameter) -> tuple[FlatGroup, ParamSlot]:
        """The group and slot of a shard parameter (what the optimizer steps)."""
        return self._slot_of_shard[id(shard_param)]

    # -- accounting -------------------------------------------------------------------------------

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds now, by category of the byte ledger (``memory/buffers.py``), and peaks since the
        engine was created (its ``setup``), through every phase of the run until now: initialisation,
        training steps, evaluation, checkpoint save and load, teardown. ``peak_total`` is the highest sum of
        the in-memory categories at any moment; ``peak_<category>`` the highest of each. With
        ``secondary_shard_size`` = s, ``secondary_shards`` holds 1/s of each unit released after its forward
        until its backward is over: at its peak, between forward and backward, about 1/s of the units'
        gathered bytes (see [Note: secondary shards] in engine/shard/secondary.py)."""
        self.note_optimizer_state()
        report = dict(self.ledger.held)
        report["peak_gathered_params"] = self.ledger.peak_gathered
        report["peak_total"] = self.ledger.peak_total
        for category, peak in self.ledger.peak.items():
            if category != GATHERED_PARAMS:
                report[f"peak_{category}"] = peak
        return report

    def gathered_resident_bytes(self) -> int:
        """Bytes of gathered (full) parameter buffers that are really in memory right now, asked of the
        kernel (a measurement to check the ledger's ``gathered_params`` against). A released buffer whose
        pages are parked for the next gather is not counted: the ledger counts those as staging bytes."""
        return sum(
            resident_bytes(rt.group.full)
            for rt in self.runtimes
            if not rt.group.persistent and not parking.holds(getattr(rt.group.full, "_zero3_region", None))
        )

    def unit_sizes(self) -> dict[str, int]:
        """Full (gathered) bytes of every unit (the root included), by unit name."""
        units = ([self.root] if self.root else []) + [rt for _, rt in self.unit_runtimes]
        return {rt.name: rt.group.full.numel() * rt.group.full.element_size() for rt in units}

    def set_trim_between_phases(self, on: bool) -> None:
        """Hand idle staging buffers back when backward ends and after every optimizer step (a lean level of
        the automatic plan, see [Note: the plan's levels] in plan/dynamic.py), or keep them for reuse."""
        self.trim_between_phases = on
        self.hooks.after_backward = self.pool.trim if on else None

    def trim(self) -> None:
        """Hand idle staging buffers back to the kernel (between phases: after ``fit``, before evaluation;
        after every step where ``trim_between_phases``)."""
        self.pool.trim()
        if self.offload is not None:
            self.offload.settle()
            self.offload.host.trim()
        return_free_heap()

    # -- teardown ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Remove every hook; the module gets ordinary full parameters again and each optimizer steps
        them with its full state, as if it had never been sharded (a collective). Needs the full model and
        its optimizer state in memory on every rank: for models that fit."""
        for handle in self._step_handles:
            handle.remove()
        self.hooks.remove()
        full_states = [self.full_optimizer_state(optimizer) for optimizer in self.optimizers]
        for step, flags in self._offloaded_steps:
            step.remove()
            restore_flags(step.optimizer.param_groups, flags)
        self._offloaded_steps = []
        for runtime in self.runtimes:
            runtime.group.unshard()
        for optimizer, state in zip(self.optimizers, full_states):
            for group in optimizer.param_groups:
                group["params"][:] = [self._slot_of_shard[id(p)][1].param for p in group["params"]]
            optimizer.state.clear()
            optimizer.load_state_dict(state)
        for slot in self.slots.values():
            if hasattr(slot.param, _ENGINE_ATTR):
                delattr(slot.param, _ENGINE_ATTR)
        self.module.__dict__.pop(_LINK_ATTR, None)
        self.slots = {}
        self.optimizers = []
        self.release_offload()
        self.pool.trim()
        self.comm.close_side_groups()

    def release_offload(self) -> None:
        """Remove the swap files and stop the I/O threads (local; also safe after a failure)."""
        if self.offload is not None:
            self.offload.close()
            self.offload = None

    def remove_swap_files(self) -> None:
        """Delete this rank's swap folder now, touching nothing else (no thread is joined): for a process
        about to end with ``os._exit``, which skips the interpreter's own clean-up (see failure/watchdog.py)."""
        swap = getattr(self.offload, "swap", None) if self.offload is not None else None
        if swap is not None:
            swap.remove()

    def _broadcast_buffers(self) -> None:
        with torch.no_grad():
            for buffer in self.module.buffers():
                if buffer.is_floating_point() or buffer.dtype in (torch.int64, torch.int32, torch.bool):
                    self.comm.broadcast(buffer, src=0)


def _collective_sizes(plan, dtypes: DtypePolicy, world: int) -> set[tuple[int, torch.dtype]]:
    """(full padded numel, dtype) of every all-gather and reduce-scatter the groups of ``plan`` will issue."""
    sizes = set()
    for params in [spec.params for spec in plan.units] + [plan.persistent]:
        if params:
            numel = sum(p.numel() for _, p in params)
            dtype = params[0][1].dtype
            for used in (dtypes.compute or dtype, dtypes.reduce or dtype):
                sizes.add((-(-numel // world) * world, used))
    return sizes


def unshard(module: nn.Module) -> None:
    """Turn a module sharded by zero3 back into an ordinary one: full weights on every rank, its optimizers
    over them with their full state (a collective: call it on every rank; needs the whole model in memory).
    Nothing happens to a module that is not sharded."""
    engine = engine_of(module)
    if engine is not None:
        engine.close()


@contextmanager
def gathered_parameters(module: nn.Module, modifier_rank: Optional[int] = None) -> Iterator[None]:
    """Full parameters of ``module`` for the duration of the block, on every rank (call it on all ranks).

    Outside zero3 (DDP, one device) this does nothing, so code using it runs under any strategy.
    """
    refs = (getattr(p, _ENGINE_ATTR, None) for p in module.parameters())
    engines = {id(e): e for ref in refs if ref is not None and (e := ref()) is not None}
    if not engines:
        yield
        return
    if len(engines) > 1:
        raise RuntimeError("zero3: the module's parameters belong to more than one zero3 engine.")
    (engine,) = engines.values()
    with engine.gathered_parameters(module, modifier_rank=modifier_rank):
        yield
