"""Module and autograd hooks: when each unit is gathered, reduced and released.

Per unit, three reasons keep its full parameters gathered; it is released when none holds:
  - ``forward_depth``: its forward is running (nested or repeated calls count separately);
  - ``backward_hold``: its backward has started (or is due right after its forward, see
    ``Schedule.keep_for_backward``) and its gradients are not reduced yet;
  - ``context_holds``: a ``gathered_parameters`` block is open on it.

Forward:  pre-hook gathers (and prefetches the next units, see ``schedule.py``); post-hook registers a
          pre-backward hook on the outputs and releases.
Backward: the pre-backward hook (first gradient reaching an output) re-gathers; each parameter's
          post-accumulate-grad hook counts it in; when every trainable parameter of the group has its
          gradient, the group's gradients are reduce-scattered and the unit is released.
End:      a callback queued on the autograd engine reduces what is left (parameters that got no
          gradient this step) and releases everything not held by a running forward.

[Note: forward inside backward]
Activation checkpointing re-runs a unit's forward during backward. Releasing after that forward would
free weights that the recomputed graph is about to use, and torch's non-reentrant checkpoint may stop
the recomputation early, so the post-forward hook may never run. Hence a pre-forward hook that runs
inside backward (``_current_graph_task_id() != -1``) takes a backward hold, released like any other
once the unit's gradients are reduced, and the post-forward hook does nothing there. Autograd
calls a parameter's accumulate node once per backward even when the parameter was used several times
(a module called twice, tied weights), so the gradient count stays exact; should a later gradient
arrive anyway, the end-of-backward callback reduces it (reduction adds into the shard).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils.hooks import RemovableHandle

from .comm import Communicator
from .grads import pack_gradients, reduce_packed
from .schedule import Schedule
from .shard import FlatGroup, start_gathers


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class UnitRuntime:
    """The gather / release / reduce state of one flat group (a unit's, or the persistent one)."""

    def __init__(self, name: str, group: FlatGroup, comm: Communicator) -> None:
        self.name = name
        self.group = group
        self.comm = comm
        self.forward_depth = 0
        self.backward_hold = False
        self.backward_started = False  # its pre-backward hook ran in the current backward
        self.context_holds = 0
        self.grads_ready = 0  # trainable parameters whose gradient arrived this backward

    def acquire(self) -> None:
        self.group.gather()

    def maybe_release(self) -> None:
        if self.forward_depth == 0 and not self.backward_hold and self.context_holds == 0:
            self.group.release()

    def pack(self):
        """This unit's gradients, packed for reduction (see ``grads.pack_gradients``)."""
        self.grads_ready = 0
        return pack_gradients(self.group, self.comm)


MAX_INFLIGHT_REDUCES = 2


class HookManager:
    """Installs the hooks of every unit and drives ``UnitRuntime`` (and the prefetch ``Schedule``) from them.

    The root unit (if it owns sharded parameters) is gathered for the whole forward and backward and
    is not prefetched; a forward of the root module starts a new pass of the schedule. With
    ``overlap``, prefetched gathers and reduce-scatters run asynchronously, at most
    ``MAX_INFLIGHT_REDUCES`` reduce-scatters in flight; everything is complete when backward ends.
    """

    def __init__(
        self,
        root_module: nn.Module,
        root: Optional[UnitRuntime],
        units: list[tuple[nn.Module, UnitRuntime]],
        persistent: Optional[UnitRuntime],
        schedule: Schedule,
        overlap: bool,
        reduce_bucket_numel: int = 0,
        read_ahead: int = 0,
    ) -> None:
        self.root = root
        self.read_ahead = read_ahead  # units whose parameter shards are read from NVMe ahead of use
        self.reduce_bucket_numel = reduce_bucket_numel
        self._bucket: list = []  # packed gradients of small units waiting to be reduced together
        self.schedule = schedule
        self.overlap = overlap
        self.runtimes = [rt for rt in [root, *(rt for _, rt in units), persistent] if rt is not None]
        self._handles: list[RemovableHandle] = []
        self._root_depth = 0
        self._backward_running = False  # a backward pass has started and its end callback is queued
        self._reductions: deque = deque()  # reduce-scatters in flight
        self._handles.append(root_module.register_forward_pre_hook(self._root_pre_forward, prepend=True))
        self._handles.append(root_module.register_forward_hook(self._root_post_forward))
        for module, runtime in ([(root_module, root)] if root else []) + units:
            self._handles.append(module.register_forward_pre_hook(self._pre_forward(runtime)))
            self._handles.append(module.register_forward_hook(self._post_forward(runtime)))
        for runtime in self.runtimes:
            for slot in runtime.group.trainable_slots:
                self._handles.append(slot.param.register_post_accumulate_grad_hook(self._grad_ready(runtime)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _start(self, phase: str, runtime: UnitRuntime) -> None:
        """Gather ``runtime`` and issue the prefetches the schedule asks for (root: no schedule)."""
        if runtime is self.root:
            runtime.acquire()
            return
        ahead = self.schedule.on_start(phase, runtime)
        for unit in self.schedule.upcoming(phase, self.read_ahead):
            unit.group.prefetch_input()
        start_gathers([runtime.group] + [unit.group for unit in ahead], self.reduce_bucket_numel)
        runtime.acquire()

    # -- forward ----------------------------------------------------------------------------------

    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        if not in_backward():
            if self._root_depth == 0:
                self.schedule.begin("forward")
            self._root_depth += 1

    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not in_backward():
            self._root_depth -= 1

    def _pre_forward(self, runtime: UnitRuntime) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            if in_backward():
                # [Note: forward inside backward]
                runtime.backward_hold = True
                runtime.acquire()
                return
            runtime.forward_depth += 1
            self._start("forward", runtime)

        return hook

    def _post_forward(self, runtime: UnitRuntime) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if in_backward():
                return  # [Note: forward inside backward]
            runtime.forward_depth -= 1
            if torch.is_grad_enabled():
                self._register_pre_backward(runtime, output)
                if runtime is not self.root and self.schedule.keep_for_backward(runtime):
                    runtime.backward_hold = True  # re-used right away by backward: do not release
            runtime.maybe_release()

        return hook

    # -- backward ---------------------------------------------------------------------------------

    def _register_pre_backward(self, runtime: UnitRuntime, output: Any) -> None:
        def hook(grad: torch.Tensor) -> None:
            self._begin_backward()
            if not runtime.backward_started:
                runtime.backward_started = True
                runtime.backward_hold = True
                self._start("backward", runtime)

        for tensor in _tensors_in(output):
            if tensor.requires_grad:
                tensor.register_hook(hook)

    def _grad_ready(self, runtime: UnitRuntime) -> Callable:
        def hook(param: torch.Tensor) -> None:
            self._begin_backward()
            runtime.grads_ready += 1
            if runtime.grads_ready >= len(runtime.group.trainable_slots):
                self._reduce(runtime)
                runtime.backward_hold = False
                runtime.maybe_release()

        return hook

    def _reduce(self, runtime: UnitRuntime) -> None:
        """Reduce a unit's gradients: alone if it is large, else in a bucket with other small units,
        sent once it holds ``reduce_bucket_numel`` elements (or when backward ends)."""
        flat = runtime.pack()
        if flat is None:
            return
        if flat.numel() >= self.reduce_bucket_numel:
            self._issue([(runtime.group, flat)])
            return
        self._bucket.append((runtime.group, flat))
        if sum(f.numel() for _, f in self._bucket) >= self.reduce_bucket_numel:
            self._flush_bucket()

    def _flush_bucket(self) -> None:
        if self._bucket:
            bucket, self._bucket = self._bucket, []
            self._issue(bucket)

    def _issue(self, packed: list) -> None:
        accumulation = reduce_packed(packed, packed[0][0].comm, async_op=self.overlap)
        if accumulation is not None:
            self._reductions.append(accumulation)
            while len(self._reductions) > MAX_INFLIGHT_REDUCES:
                self._reductions.popleft().wait()

    def _begin_backward(self) -> None:
        if not self._backward_running:
            self._backward_running = True
            self.schedule.begin("backward")
            Variable._execution_engine.queue_callback(self._finish_backward)

    def _finish_backward(self) -> None:
        for runtime in self.runtimes:
            if runtime.grads_ready > 0:
                self._reduce(runtime)
        self._flush_bucket()
        while self._reductions:
            self._reductions.popleft().wait()
        for runtime in self.runtimes:
            runtime.backward_hold = runtime.backward_started = False
            runtime.maybe_release()
        self.schedule.end_backward()
        self._backward_running = False


def _tensors_in(output: Any) -> list[torch.Tensor]:
    """Every tensor inside a (nested) module output: tensors, lists, tuples, dicts, dataclass-like."""
    found: list[torch.Tensor] = []
    stack = [output]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return found
