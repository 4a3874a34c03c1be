"""The user's optimizer, stepped on the host over offloaded shards, one group at a time.

``make_host_fused`` switches ``torch.optim.Adam`` / ``AdamW`` to torch's fused CPU kernel (one pass over
each tensor, near memory bandwidth) when the user left ``fused`` unset; other optimizers step as they are.

[Note: pipelined step]
``PipelinedStep`` replaces ``optimizer.step`` on the instance. It runs the closure (forward and
backward) first, as every torch optimizer does, then steps the optimizer *group by group* (NVMe; in host memory one call steps every group): for each
flat group it narrows every parameter group to that group's shard parameters, calls the original
step, writes the group back to its tier and refreshes the gather source. Under the NVMe tier the reads
of the next ``offload_buffer_count - 1`` groups are in flight while the current one steps, and its
writes drain behind the next steps; at most ``offload_buffer_count`` groups are in host memory at
once. Stepping group by group gives the same numbers as one step over everything for optimizers
whose update is per parameter (all of ``torch.optim`` but LBFGS, which needs the whole problem at
once: it is refused under offload). Hyper-parameters, LR schedulers and state keys are untouched: the
parameter groups are the user's own, only their ``params`` lists are narrowed for the call.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ...errors import OptimizerShardingError
from .source import ParamSource
from .store import GroupStore
from .streaming import pipelined

_FUSED_CAPABLE = (torch.optim.Adam, torch.optim.AdamW)


def make_host_fused(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Use the fused CPU kernel where the optimizer allows it; returns the groups' original flags."""
    originals = [{k: group.get(k) for k in ("fused", "foreach")} for group in optimizer.param_groups]
    if type(optimizer) not in _FUSED_CAPABLE:
        return originals
    for group in optimizer.param_groups:
        if group.get("fused") is None and not group.get("differentiable") and not group.get("capturable"):
            if all(p.dtype in (torch.float32, torch.float16, torch.bfloat16) for p in group["params"]):
                group["fused"], group["foreach"] = True, False
    return originals


def restore_flags(param_groups: list[dict], originals: list[dict]) -> None:
    for group, flags in zip(param_groups, originals):
        group.update(flags)


class PipelinedStep:
    """``optimizer.step`` under offload (see [Note: pipelined step])."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        stores: list[GroupStore],
        sources: list[ParamSource],
        buffer_count: int,
        after: Callable[[], None],
    ) -> None:
        if isinstance(optimizer, torch.optim.LBFGS):
            raise OptimizerShardingError(
                "zero3: LBFGS re-evaluates the closure over all parameters at once, which offload cannot "
                "step group by group; use another optimizer or turn `offload_optimizer` off."
            )
        self.optimizer = optimizer
        self.stores = stores
        self.source_of = {id(source.store): source for source in sources}
        self.buffer_count = buffer_count
        self.after = after
        self.original = optimizer.__dict__.get("step")  # an instance wrapper (LR scheduler), if any
        self.bound = optimizer.step
        self.substeps = 0
        optimizer.step = self  # type: ignore[method-assign]

    def remove(self) -> None:
        if self.original is not None:
            self.optimizer.step = self.original  # type: ignore[method-assign]
        else:
            self.optimizer.__dict__.pop("step", None)

    def __call__(self, closure: Optional[Callable] = None, **kwargs):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stores = [s for s in self.stores if s.has_gradient()]
        if not stores:
            self.after()
            return loss
        offload = stores[0].offload
        if not offload.nvme:  # host memory: nothing to overlap, one call steps all
            for store in stores:
                store.attach()
            self._step_only(stores, kwargs)
            for store in stores:
                self.source_of[id(store)].publish()
            self.after()
            return loss
        ahead = max(1, self.buffer_count // 2)  # groups read ahead
        writing = max(0, self.buffer_count - ahead - 1)  # groups whose writes may still drain

        def start(store: GroupStore) -> None:
            offload.throttle(writing)
            store.start_load()

        def finish(store: GroupStore) -> None:
            store.attach()
            self._step_only([store], kwargs)
            self.source_of[id(store)].publish()
            store.evict()

        pipelined(stores, ahead, start, finish)
        offload.throttle(0)
        self.after()
        return loss

    def _step_only(self, stores: list[GroupStore], kwargs: dict) -> None:
        wanted = {id(view.param) for store in stores for view in store.views}
        groups = self.optimizer.param_groups
        full = [group["params"] for group in groups]
        try:
            for group in groups:
                group["params"] = [p for p in group["params"] if id(p) in wanted]
            self.substeps += 1
            self.bound(**kwargs)
        finally:
            for group, params in zip(groups, full):
                group["params"] = params
