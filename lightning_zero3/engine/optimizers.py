"""The engine's optimizer side: the user's optimizers moved onto the shards, their state in and out of
the offload tiers, and the full (unsharded) optimizer state for checkpoints.

``OptimizerSide`` is mixed into ``Zero3Engine`` (``engine.py``) and reads the engine's own attributes:
``slots``, ``runtimes``, ``offload``, ``ledger``, ``optimizers``, ``host_sized``, ``refresh_gathered``,
``trim_between_phases`` and ``trim``.
It lives apart so that each file keeps one job; it is never used alone.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from .grads.optim import optimizer_params, shard_optimizer
from .memory.buffers import OPTIMIZER_STATE, optimizer_state_bytes, return_free_heap
from .offload import PipelinedStep, make_host_fused, restore_flags
from .shard.flat_group import FlatGroup
from .state.optimizer_state import full_optimizer_state, load_full_optimizer_state


class OptimizerSide:
    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Make ``optimizer`` step this rank's shards (in place; returns it for convenience)."""
        shard_optimizer(optimizer, self.slots)
        owners = (self._slot_of_shard[id(p)][0] for p in optimizer_params(optimizer))
        stepped = list({id(group): group for group in owners}.values())
        refresh = self._refresh_after_step(stepped)
        if self.offload is None:
            self._step_handles.append(optimizer.register_step_post_hook(refresh))
        else:
            self._offload_optimizer(optimizer, stepped, refresh)
        self.optimizers.append(optimizer)
        return optimizer

    def _offload_optimizer(self, optimizer: torch.optim.Optimizer, groups: list[FlatGroup], refresh) -> None:
        """Step ``optimizer`` on the host, group by group (see ``offload/host_optimizer.py``)."""
        offload = self.offload
        assert offload is not None
        state_copies = {"Adam": 2, "AdamW": 2, "SGD": 1, "Adagrad": 1, "RMSprop": 2}.get(type(optimizer).__name__, 2)
        amsgrad = any(group.get("amsgrad") for group in optimizer.param_groups)
        state_bytes = (state_copies + amsgrad) * sum(g.shard_numel * g.shard.element_size() for g in groups)
        offload.check_room(state_bytes, f"the state of {type(optimizer).__name__}")
        for group in groups:
            group.store.optimizers.append(optimizer)
        flags = make_host_fused(optimizer)
        step = PipelinedStep(
            optimizer, [g.store for g in groups], [g.source for g in groups], offload.buffer_count,
            lambda: refresh(optimizer, (), {}),
        )
        self._offloaded_steps.append((step, flags))

    def _refresh_after_step(self, groups: list[FlatGroup]):
        def hook(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
            # Shards changed: secondary shards go, and any full copy that is alive right now (persistent
            # parameters, a root whose forward is still running in manual optimization) is gathered anew.
            for group in groups:
                group.drop_secondary()
                if group.gathered:
                    group.gather(force=True)
            self.note_optimizer_state()
            if self.trim_between_phases:  # a lean level of the automatic plan (plan/dynamic.py)
                self.trim()  # also returns the free heap
            elif self.host_sized:
                return_free_heap()  # [Note: the heap between steps] in memory/buffers.py

        return hook

    def note_optimizer_state(self) -> None:
        """Bring the ledger's optimizer-state figure up to date (the optimizers create their state lazily)."""
        self.ledger.set(OPTIMIZER_STATE, optimizer_state_bytes(self.optimizers))

    def detach_optimizers(self) -> None:
        """Forget the optimizers sharded so far (a new ``fit`` builds its own), and their state."""
        for handle in self._step_handles:
            handle.remove()
        self._step_handles = []
        for step, flags in self._offloaded_steps:
            step.remove()
            restore_flags(step.optimizer.param_groups, flags)
        self._offloaded_steps = []
        if self.offload is not None:
            for store in self.offload.stores:
                store.optimizers = []
        for optimizer in self.optimizers:
            optimizer.state.clear()
        self.optimizers = []
        for slot in self.slots.values():
            slot.shard_param.grad = None
        self.note_optimizer_state()

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """The state dict an unsharded optimizer would have (a collective; holds all of it: for models that
        fit one process; single-file checkpoints stream it instead, see ``state/optimizer_state.py``)."""
        self.settle()
        full = full_optimizer_state(optimizer, self)
        full["param_groups"] = self.user_param_groups(optimizer, full["param_groups"])
        return full

    def user_param_groups(self, optimizer: torch.optim.Optimizer, param_groups: list[dict]) -> list[dict]:
        """``param_groups`` of a state dict of ``optimizer`` with the user's own ``fused`` / ``foreach``
        settings, not the host kernel that offload chose (what checkpoints should record)."""
        for step, flags in self._offloaded_steps:
            if step.optimizer is optimizer:
                return [{**group, **flag} for group, flag in zip(param_groups, flags)]
        return param_groups

    def load_full_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Load a full (unsharded) optimizer state dict, keeping this rank's slice (not a collective)."""
        self.settle()
        load_full_optimizer_state(optimizer, state, self)
        self.keep_host_kernel(optimizer)
        self.note_optimizer_state()

    def settle(self) -> None:
        """Under NVMe offload: every write landed, so the swap files hold the current values (before they
        are read or written directly, for checkpoints)."""
        if self.offload is not None:
            self.offload.settle()

    def after_states_loaded(self) -> None:
        """Masters changed in their tiers (a checkpoint was loaded): refresh what the all-gathers read and
        the full copies alive now."""
        for runtime in self.runtimes:
            if runtime.group.source is not None:
                runtime.group.source.refresh()
        self.refresh_gathered()
        return_free_heap()

    def keep_host_kernel(self, optimizer: torch.optim.Optimizer) -> None:
        """Call after ``optimizer.load_state_dict``, which brings back the user's ``fused`` / ``foreach``
        settings: under offload the host step uses the fused kernel again (as before the load)."""
        for step, _ in self._offloaded_steps:
            if step.optimizer is optimizer:
                make_host_fused(optimizer)

    @contextmanager
    def states_in_memory(self) -> Iterator[None]:
        """Every shard parameter and every optimizer's state as real, readable and writable tensors for the
        duration of the block; changes are written back to their tier on exit (and the gathered copies of
        the parameters refreshed from them). A no-op without offload. Not a collective. Under NVMe this
        holds the rank's whole states in host memory: the engine's own passes stream group by group."""
        with self._groups_in_memory([rt.group for rt in self.runtimes]):
            yield

    @contextmanager
    def _groups_in_memory(self, groups: list[FlatGroup], write_back: bool = True) -> Iterator[None]:
        """``states_in_memory`` for some groups. ``write_back=False``: read-only use (only a gradient
        loaded with them goes back, unchanged, since it was read from the file it returns to)."""
        groups = [g for g in groups if g.store is not None and not (g.store.offload.nvme and g.store.resident)]
        for group in groups:
            group.store.start_load()
        for group in groups:
            group.store.attach()
        try:
            yield
        finally:
            for group in groups:
                if write_back:
                    group.source.publish()
                    if group.stays_gathered:  # one process: its full copy is refreshed here, no collective
                        group.gather(force=True)
                group.store.evict(write_grad=group.store.grad is not None)
            if groups and self.offload is not None:
                self.offload.throttle(0)

