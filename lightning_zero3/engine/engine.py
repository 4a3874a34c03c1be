"""``Zero3Engine``: ZeRO stage 3 over one module, with no Lightning in sight.

Plain torch can drive it (the engine tests do)::

    engine = Zero3Engine(model, Zero3Config())        # shards the model in place
    optimizer = torch.optim.AdamW(model.parameters())
    engine.shard_optimizer(optimizer)                  # the optimizer now steps this rank's shards
    loss = model(batch).sum(); loss.backward()         # gathers, releases and reduce-scatters on its own
    optimizer.step(); optimizer.zero_grad()            # shards stepped; gathered copies refreshed
    engine.close()                                     # model holds ordinary full tensors again
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import nn

from ..config import Zero3Config
from .comm import Communicator
from .hooks import HookManager, UnitRuntime
from .materialize import InitFn, Materializer, has_meta_tensors
from .schedule import Schedule
from .memory import GATHERED_PARAMS, ByteLedger, optimizer_state_bytes
from .optim import clip_grad_norm_, clip_grad_value_, optimizer_params, shard_optimizer
from .shard import DtypePolicy, FlatGroup, ParamSlot
from .state import full_optimizer_state, load_full_optimizer_state
from .units import plan_units

# Which engine manages a parameter is kept on the parameter itself (a weak reference under this
# attribute), so ``gathered_parameters(module)`` works from the module alone.
_ENGINE_ATTR = "_zero3_engine"


class NoTrainableParametersError(ValueError):
    """Training was asked of a model whose parameters all have ``requires_grad=False``."""


class Zero3Engine:
    def __init__(
        self,
        module: nn.Module,
        config: Optional[Zero3Config] = None,
        comm: Optional[Communicator] = None,
        device: Optional[torch.device] = None,
        dtypes: DtypePolicy = DtypePolicy(),
        init_fn: Optional[InitFn] = None,
    ) -> None:
        """Shard ``module`` in place. Parameters on the meta device are materialised unit by unit, straight
        into shards (see [Note: sharded initialisation] in materialize.py): each module's
        ``reset_parameters()`` and then ``init_fn(module)`` initialise them on rank 0."""
        self.module = module
        self.config = config or Zero3Config()
        self.comm = comm or Communicator()
        self.ledger = ByteLedger()
        first = next(module.parameters(), None)
        meta = has_meta_tensors(module)
        if device is None and meta:
            raise ValueError("zero3: the model is on the meta device; pass `device=` to build its shards on.")
        self.device = device or (first.device if first is not None else torch.device("cpu"))
        materializer = Materializer(module, self.device, init_fn, self.comm.rank == 0) if meta else None
        if self.config.sync_module_states or meta:
            self._broadcast_buffers()

        self.plan = plan_units(module, self.config.unit_modules, self.config.persistence_threshold)
        if self.config.tune_collectives:
            # before any group exists: the tuning buffers are not stacked on top of the shards
            self.comm.tune(_collective_sizes(self.plan, dtypes, self.comm.world_size), self.device)
        sync = self.config.sync_module_states
        self.root: Optional[UnitRuntime] = None  # the root unit, if it owns sharded parameters
        self.unit_runtimes: list[tuple[nn.Module, UnitRuntime]] = []  # every other unit, in module order
        for spec in self.plan.units:
            if spec.params:
                name = spec.path or "<root>"
                group = FlatGroup(
                    name, spec.params, self.comm, self.ledger, self.device, False, sync, dtypes, materializer
                )
                runtime = UnitRuntime(name, group, self.comm)
                runtime.maybe_release()  # before the next unit is built: one unit in full at a time
                if spec is self.plan.root:
                    self.root = runtime
                else:
                    self.unit_runtimes.append((spec.module, runtime))
        self.persistent: Optional[UnitRuntime] = None
        if self.plan.persistent:
            group = FlatGroup(
                "<persistent>", self.plan.persistent, self.comm, self.ledger, self.device, True, sync, dtypes,
                materializer,
            )
            self.persistent = UnitRuntime(group.name, group, self.comm)
        if materializer is not None:
            materializer.check_done(module)
        units = [rt for _, rt in self.unit_runtimes]
        self.runtimes = [rt for rt in [self.root, *units, self.persistent] if rt is not None]
        self.slots: dict[int, ParamSlot] = {}  # by id of the user's parameter
        self._slot_of_shard: dict[int, tuple[FlatGroup, ParamSlot]] = {}  # by id of the shard parameter
        for runtime in self.runtimes:
            for slot in runtime.group.slots:
                self.slots[id(slot.param)] = slot
                self._slot_of_shard[id(slot.shard_param)] = (runtime.group, slot)
                setattr(slot.param, _ENGINE_ATTR, weakref.ref(self))
        cfg = self.config
        self.schedule = Schedule(
            units, self.comm, cfg.prefetch_bucket_size, cfg.max_live_parameters, cfg.max_reuse_distance
        )
        self.hooks = HookManager(
            module, self.root, self.unit_runtimes, self.persistent, self.schedule, cfg.overlap_comm,
            cfg.reduce_bucket_size,
        )
        self.ledger.reset_peak()
        self.optimizers: list[torch.optim.Optimizer] = []
        self._step_handles: list = []

    # -- optimizer --------------------------------------------------------------------------------

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Make ``optimizer`` step this rank's shards (in place; returns it for convenience)."""
        shard_optimizer(optimizer, self.slots)
        owners = (self._slot_of_shard[id(p)][0] for p in optimizer_params(optimizer))
        stepped = {id(group): group for group in owners}
        self._step_handles.append(optimizer.register_step_post_hook(self._refresh_after_step(list(stepped.values()))))
        self.optimizers.append(optimizer)
        return optimizer

    @staticmethod
    def _refresh_after_step(groups: list[FlatGroup]):
        def hook(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
            # Shards changed: any full copy that is alive right now (persistent parameters, a root
            # whose forward is still running in manual optimization) is gathered anew.
            for group in groups:
                if group.gathered:
                    group.gather(force=True)

        return hook

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """The state dict an unsharded optimizer would have (a collective; see ``state.py``)."""
        return full_optimizer_state(optimizer, self._slot_of_shard, self.comm)

    def load_full_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Load a full (unsharded) optimizer state dict, keeping this rank's slice."""
        load_full_optimizer_state(optimizer, state, self._slot_of_shard, self.comm)

    @property
    def shard_params(self) -> list[nn.Parameter]:
        return [slot.shard_param for slot in self.slots.values()]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, params=None) -> torch.Tensor:
        return clip_grad_norm_(params if params is not None else self.shard_params, max_norm, self.comm, norm_type)

    def clip_grad_value_(self, clip_value: float, params=None) -> None:
        clip_grad_value_(params if params is not None else self.shard_params, clip_value)

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
            for runtime in runtimes:
                if modifier_rank is not None:
                    runtime.group.write_back(src=modifier_rank)
                runtime.context_holds -= 1
                runtime.maybe_release()

    # -- full state dicts ---------------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """``module.state_dict()`` with full parameters in the master dtype (a collective; holds a full copy)."""
        own = self.module.state_dict(keep_vars=True)  # keep_vars: no op touches the released parameters
        full: dict[int, torch.Tensor] = {}
        for runtime in self.runtimes:
            master = runtime.group.gather_master()
            for slot in runtime.group.slots:
                full[id(slot.param)] = master[slot.offset : slot.offset + slot.numel].view(slot.param.shape).clone()
        return {name: full[id(v)] if id(v) in full else v.detach().clone() for name, v in own.items()}

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load full (unsharded) weights: each rank keeps its slice, in the master dtype. Buffers are copied."""
        own = self.module.state_dict(keep_vars=True)
        missing, unexpected = sorted(own.keys() - state_dict.keys()), sorted(state_dict.keys() - own.keys())
        if strict and (missing or unexpected):
            raise KeyError(f"zero3: state dict does not fit the model: missing {missing}, unexpected {unexpected}.")
        with torch.no_grad():
            for name, value in state_dict.items():
                target = own.get(name)
                slot = self.slots.get(id(target)) if target is not None else None
                if slot is not None:
                    self._slot_of_shard[id(slot.shard_param)][0].load_slice(slot, value)
                elif target is not None:
                    target.copy_(value)
        for runtime in self.runtimes:
            if runtime.group.gathered:
                runtime.group.gather(force=True)

    # -- accounting -------------------------------------------------------------------------------

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds, by category, plus the peak of gathered (full) parameter bytes."""
        report = dict(self.ledger.held)
        report["optimizer_state"] = optimizer_state_bytes(self.optimizers)
        report["peak_gathered_params"] = self.ledger.peak_gathered
        return report

    def unit_sizes(self) -> dict[str, int]:
        """Full (gathered) bytes of every unit (the root included), by unit name."""
        units = ([self.root] if self.root else []) + [rt for _, rt in self.unit_runtimes]
        return {rt.name: rt.group.full.numel() * rt.group.full.element_size() for rt in units}

    @property
    def gathered_bytes(self) -> int:
        return self.ledger.held[GATHERED_PARAMS]

    # -- teardown ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Remove every hook; the module gets ordinary full parameters again and each optimizer steps
        them with its full state, as if it had never been sharded (a collective)."""
        for handle in self._step_handles:
            handle.remove()
        self.hooks.remove()
        full_states = [self.full_optimizer_state(optimizer) for optimizer in self.optimizers]
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
        self.slots = {}
        self.optimizers = []

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
