"""Module and autograd hooks: when each unit is gathered, released and handed to the reduction queue.

Forward:  pre-hook gathers (and prefetches the next units, see ``schedule/prefetch.py``) and passes the unit's
          inputs that need gradients through ``_PostBackward``; post-hook registers a pre-backward hook on
          the outputs and releases.
Backward: the pre-backward hook (first gradient reaching an output) re-gathers. The unit's backward is
          over when ``_PostBackward`` fires, or (a unit without that signal, see [Note: counting a
          unit's gradients]) when every trainable parameter has its gradient, or at the end of backward,
          whichever comes first: it is released then and, if trainable, handed to the reduction queue
          (``grads.ReductionQueue``), which reduce-scatters in an order every rank shares.
End:      a callback queued on the autograd engine ends every unit's backward, lets the queue finish and
          releases everything not held by a running forward.
The reasons that keep a unit gathered, and its states within a backward, are in ``shard/runtime.py``.

[Note: post-backward signal]
A unit whose parameters did not all get a gradient (an expert no token was routed to, a frozen unit)
would otherwise stay gathered, and its reduction pending, until backward ends. As torch FSDP2 does, the
pre-forward hook passes the unit's input tensors that need gradients through an identity autograd
Function; its backward runs when the gradients of those inputs are computed, which is once every node
the unit's forward created has run (the autograd engine runs ready nodes newest first, and every node of
the unit is newer than the identity). A unit called k times waits for its k signals (tokens held by the
graph, so a graph dropped without backward drops its token). Frozen units are released this way as soon
as their backward is over, and are not held for backward at all when their outputs need no gradient.
Every parameter's gradient accumulator runs before the signal does: autograd runs a ready accumulator
before any other node, and each of the unit's is ready once the unit's nodes that feed it have run.

[Note: counting a unit's gradients]
A unit whose inputs need no gradient (the root, fed token ids; a block behind frozen embeddings) has
no post-backward signal. Its backward is over when each trainable parameter's post-accumulate hook has
fired; the hooks are installed on its parameters at the first forward that finds no input to pass
through ``_PostBackward``, and only there: a hook per parameter, called from the autograd engine, was
the costliest host work of a small model's step when every unit had them. A gradient that reaches a
parameter after its unit was reduced (the parameter is used outside its unit's forward) is an error,
raised by that hook, or, for a unit with the signal, when backward ends (``_check_no_late_gradients``):
every rank has sent the unit without it.
The identity returns detached aliases of its inputs (same storage, same version counter), not the inputs
themselves, which autograd would turn into views that refuse in-place changes: a module may modify its
input in place exactly as it could without zero3.

[Note: hooks under torch.compile]
A compiled model runs its modules' hooks inside the code dynamo traces. Traced, a hook's gathers, class
swaps of released parameters and schedule bookkeeping would be turned into a graph (and released
parameters, which have no data, fail there). So every module hook is wrapped in
``torch.compiler.disable``: dynamo breaks the graph at each hook, runs it as ordinary Python, and
compiles the module code between the hooks, where the unit's parameters are gathered. (Autograd's
hooks run in the backward engine, outside any traced graph.)

[Note: forward inside backward]
Activation checkpointing re-runs a unit's forward during backward. Releasing after that forward would
free weights that the recomputed graph is about to use, and torch's non-reentrant checkpoint may stop
the recomputation early, so the post-forward hook may never run. Hence a pre-forward hook that runs
inside backward (``_current_graph_task_id() != -1``) takes a backward hold, released like any other
once the unit's backward is over, and adds no post-backward signal (the original forward's is in the
graph); the post-forward hook does nothing there. Autograd calls a parameter's accumulate node once per
backward even when the parameter was used several times (a module called twice, tied weights), so the
gradient count stays exact.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils.hooks import RemovableHandle

from ..comm.agreement import ExecutionOrderError
from ..grads.reduction import ReductionQueue
from ..shard.runtime import BackwardPhase, PostBackwardToken, UnitRuntime
from .gathers import start_gathers
from .prefetch import Schedule
from .residency import Residency


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class RequiresGradChangedError(RuntimeError):
    """A parameter was frozen or unfrozen after zero3 sharded the model."""


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward calls ``fire(token)`` (see [Note: post-backward signal])."""

    @staticmethod
    def forward(ctx: Any, fire: Callable, token: PostBackwardToken, *tensors: torch.Tensor) -> tuple:
        ctx.fire, ctx.token = fire, token
        # aliases, not the inputs themselves: autograd would make those views that refuse in-place changes
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        ctx.fire(ctx.token)
        return (None, None, *grads)


class HookManager:
    """Installs the hooks of every unit and drives ``UnitRuntime``, the prefetch ``Schedule`` and the
    ``ReductionQueue`` from them.

    The root unit (if it owns sharded parameters) is gathered for the whole forward and backward (kept
    from one into the other) and is not prefetched; a forward of the root module starts a new pass of
    the schedule, and its start issues the first gathers of that pass (so does the end of a forward, for
    its backward). Prefetched gathers run asynchronously; everything is complete when backward ends.
    """

    def __init__(
        self,
        root_module: nn.Module,
        root: Optional[UnitRuntime],
        units: list[tuple[nn.Module, UnitRuntime]],
        persistent: Optional[UnitRuntime],
        schedule: Schedule,
        queue: ReductionQueue,
        coalesce_below: int = 0,
        read_ahead: int = 0,
        residency: Optional[Residency] = None,
    ) -> None:
        self.root = root
        self.persistent = persistent
        self.residency = residency  # units kept gathered across evaluation calls (residency.py)
        self.read_ahead = read_ahead  # units whose parameter shards are read from NVMe ahead of use
        self.coalesce_below = coalesce_below  # units smaller than this share one all-gather
        self.schedule = schedule
        self.queue = queue
        self.runtimes = [rt for rt in [root, *(rt for _, rt in units), persistent] if rt is not None]
        self._handles: list[RemovableHandle] = []
        self._root_depth = 0
        self._backward_running = False  # a backward pass has started and its end callback is queued
        self.after_backward: Optional[Callable[[], None]] = None  # called once every gradient is reduced
        self._handles.append(root_module.register_forward_pre_hook(_eager(self._root_pre_forward), prepend=True))
        self._handles.append(root_module.register_forward_hook(_eager(self._root_post_forward)))
        for module, runtime in ([(root_module, root)] if root else []) + units:
            self._handles.append(module.register_forward_pre_hook(_eager(self._pre_forward(runtime)), with_kwargs=True))
            self._handles.append(module.register_forward_hook(_eager(self._post_forward(runtime))))
        self._counted: set[int] = set()  # ids of the runtimes whose parameters have counting hooks

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _start(self, phase: str, runtime: UnitRuntime) -> None:
        """Gather ``runtime`` and issue the prefetches the schedule asks for (root: its first units)."""
        if self.residency is not None and phase == "forward":
            self.residency.unit_started(runtime)
        self._gather(phase, runtime)

    def _gather(self, phase: str, runtime: UnitRuntime) -> None:
        if runtime is self.root:  # not in the traces: it opens the pass, with the first units ahead
            ahead = self.schedule.ahead_of_next(phase)
        else:
            start = self.schedule.on_start(phase, runtime)
            if start.changed:
                self._release_unheld(keep=runtime)  # prefetched for the old order
            evaluating = self.residency is not None and self.residency.active
            for unit in self.schedule.upcoming(phase, self.read_ahead, wrap=evaluating):
                unit.group.prefetch_input()
            ahead = start.ahead
        start_gathers([runtime.group] + [unit.group for unit in ahead], self.coalesce_below)
        if self.residency is not None and phase == "forward" and self.residency.profiling:
            # in the profile calls of an evaluation stage, how long the forward waited for this unit's own
            # gather (residency.py); issuing the gathers ahead is not this unit's wait
            began = time.perf_counter()
            runtime.acquire()
            self.residency.record(runtime, time.perf_counter() - began)
        else:
            runtime.acquire()

    def _release_unheld(self, keep: Optional[UnitRuntime] = None) -> None:
        """Release every unit that is gathered (or in flight) for no reason any more: prefetched for an
        order that did not come. Every rank prefetched the same units, so every rank releases the same."""
        for runtime in self.runtimes:
            if runtime is not keep and not runtime.held():
                runtime.maybe_release()

    # -- forward ----------------------------------------------------------------------------------

    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        if not in_backward():
            if self._root_depth == 0:
                if self.residency is not None:
                    self.residency.forward_call(torch.is_grad_enabled())
                if not self._backward_running:
                    self._drop_holds_for_a_backward_not_run()
                self.schedule.begin("forward")
            self._root_depth += 1

    def _drop_holds_for_a_backward_not_run(self) -> None:
        """A forward starts while units are still held for the backward of an earlier one (the root, the
        last unit, the backward's first gathers ahead): that backward has not run and may never run (a
        forward whose output was not backpropagated), so they are released, and this forward's memory is
        the same as every step's. A backward that does come later gathers them at its units' starts."""
        for runtime in self.runtimes:
            if runtime.backward_hold and runtime.phase is BackwardPhase.IDLE:
                runtime.backward_hold = False
        self._release_unheld()

    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not in_backward():
            self._root_depth -= 1
            if self._root_depth == 0:
                self.schedule.end_forward()
                self._release_unheld()  # prefetched beyond where this pass stopped
                needing = [t for t in _tensors_in(output) if t.requires_grad]
                if needing:
                    self._gather_ahead_for_backward()
                    if self.root is None and self.persistent is not None and self.persistent.trainable:
                        self._begin_backward_at(needing)  # a root unit's pre-backward hook does it otherwise

    def _begin_backward_at(self, tensors: list[torch.Tensor]) -> None:
        """[Note: the persistent group lands when backward begins]
        The persistent group has no module of its own, so no unit's pre-backward hook lands its
        gradients (see [Note: gradients land in a pooled buffer] in engine/shard/flat_group.py); left alone, autograd
        allocated each of its parameters' gradients, and packing copied them one by one, a kernel each
        on a GPU: the biases and norms of every block under ``persistence_threshold``, and the whole
        model where every parameter is small. So the group lands when backward begins: at a hook on the
        root module's outputs, which fires before any parameter's gradient (where the root owns sharded
        parameters, the root unit's own pre-backward hook on those outputs does it, and no second hook is
        added), or else at whichever hook of the backward fires first (a gradient that arrived before is
        packed from where it is)."""

        def hook(grad: torch.Tensor) -> None:
            self._begin_backward()

        for tensor in tensors:
            tensor.register_hook(hook)

    def _gather_ahead_for_backward(self) -> None:
        """A forward that backward will follow ended: agree now on the first gathers of the backward, so
        that its first start issues them at once instead of agreeing on them there, a unit late (see
        [Note: a blocking check takes the gathers ahead along] in gathers.py), else the first block gathered
        in backward waits for a gather issued at its own start. A forward whose backward never comes leaves them gathered until the next forward starts
        (``_drop_holds_for_a_backward_not_run``)."""
        ahead = self.schedule.ahead_of_next("backward", from_start=True)
        if ahead:
            start_gathers([unit.group for unit in ahead], self.coalesce_below, first_needed=False)

    def _pre_forward(self, runtime: UnitRuntime) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple]:
            if in_backward():
                # [Note: forward inside backward]
                runtime.backward_hold = True
                runtime.acquire()
                return None
            runtime.forward_depth += 1
            self._start("forward", runtime)
            if torch.is_grad_enabled():
                return self._signal_post_backward(runtime, args, kwargs)
            return None

        return hook

    def _signal_post_backward(self, runtime: UnitRuntime, args: tuple, kwargs: dict) -> Optional[tuple]:
        """Pass the inputs that need gradients through ``_PostBackward`` (see [Note: post-backward signal])."""
        found = [t for t in _tensors_in((args, kwargs)) if t.requires_grad]
        if not found:
            self._count_gradients(runtime)
            return None
        token = PostBackwardToken()
        runtime.awaiting.add(token)
        runtime.signals += 1
        passed = _PostBackward.apply(functools.partial(self._post_backward, runtime), token, *found)
        swap = {id(t): out for t, out in zip(found, passed)}
        return _replace_tensors((args, kwargs), swap)

    def _post_forward(self, runtime: UnitRuntime) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if in_backward():
                return  # [Note: forward inside backward]
            runtime.forward_depth -= 1
            if torch.is_grad_enabled():
                needing = [t for t in _tensors_in(output) if t.requires_grad]
                self._register_pre_backward(runtime, needing)
                # re-used right away by backward: do not release. The root's pre-backward hook, on the
                # model's output, fires first in backward, which keeps it gathered to the end anyway
                if needing and (runtime is self.root or self.schedule.keep_for_backward(runtime)):
                    runtime.backward_hold = True
                if needing:
                    runtime.group.keep_secondary_on_release()  # [Note: secondary shards] in engine/shard/secondary.py
            runtime.maybe_release()

        return hook

    # -- backward ---------------------------------------------------------------------------------

    def _register_pre_backward(self, runtime: UnitRuntime, tensors: list[torch.Tensor]) -> None:
        def hook(grad: torch.Tensor) -> None:
            self._begin_backward()
            if runtime.start_backward():
                self._start("backward", runtime)
                runtime.group.land_gradients()  # [Note: gradients land in a pooled buffer] in engine/shard/flat_group.py
            self.queue.advance()

        for tensor in tensors:
            tensor.register_hook(hook)

    def _post_backward(self, runtime: UnitRuntime, token: PostBackwardToken) -> None:
        self._begin_backward()
        runtime.awaiting.discard(token)
        if not runtime.awaiting:
            self._backward_over(runtime)

    def _count_gradients(self, runtime: UnitRuntime) -> None:
        """Install the counting hooks of [Note: counting a unit's gradients] on ``runtime``'s parameters
        (once; the unit is gathered, in its pre-forward hook)."""
        if id(runtime) in self._counted or not runtime.trainable:
            return
        self._counted.add(id(runtime))
        for slot in runtime.group.trainable_slots:
            self._handles.append(slot.param.register_post_accumulate_grad_hook(self._grad_ready(runtime)))

    def _grad_ready(self, runtime: UnitRuntime) -> Callable:
        def hook(param: torch.Tensor) -> None:
            if not self._backward_running:  # _begin_backward's own check, inline: this hook runs per parameter
                self._begin_backward()
            if runtime.phase is BackwardPhase.REDUCED:
                raise _late_gradient(runtime, param)
            runtime.grads_ready += 1
            if runtime.all_grads_in():
                self._backward_over(runtime)
            elif self.queue.reducing:  # else there is nothing to retire, and no new turn (a hook per parameter)
                self.queue.advance()

        return hook

    def _backward_over(self, runtime: UnitRuntime) -> None:
        if runtime.end_backward():
            runtime.maybe_release()
        self.queue.advance()

    def _begin_backward(self) -> None:
        if not self._backward_running:
            self._backward_running = True
            self.schedule.begin("backward")
            self.queue.begin(self.schedule.traces["backward"])
            if self.persistent is not None:
                # [Note: the persistent group lands when backward begins]
                self.persistent.group.land_gradients()
            Variable._execution_engine.queue_callback(self._finish_backward)

    def _finish_backward(self) -> None:
        try:
            for runtime in self.runtimes:
                runtime.end_backward()
            self.queue.finish()
        finally:
            for runtime in self.runtimes:
                runtime.reset_backward()
                runtime.maybe_release()
            self._backward_running = False
        self.schedule.end_backward()  # compares recorded traces across ranks (may raise)
        _check_trainable_set(self.runtimes)
        _check_no_late_gradients(self.runtimes)
        if self.after_backward is not None:
            self.after_backward()


def _late_gradient(runtime: UnitRuntime, param: torch.Tensor) -> ExecutionOrderError:
    """[Note: counting a unit's gradients]: ``param`` got its gradient after its unit was reduced."""
    return ExecutionOrderError(
        f"zero3: {getattr(param, '_zero3_name', 'a parameter')} of unit {runtime.name!r} received its "
        "gradient after the unit's backward was over and its gradients were sent: the parameter is "
        "used outside its unit's forward. Use it only inside that module's forward, or choose "
        "`unit_modules` so that every module using it sits in one unit."
    )


def _check_no_late_gradients(runtimes: list[UnitRuntime]) -> None:
    """Every trainable group was reduced in this backward, and packing dropped its parameters' ``.grad``:
    one that has a ``.grad`` again received it after that (see [Note: counting a unit's gradients])."""
    for runtime in runtimes:
        late = runtime.group.late_gradient()
        if late is not None:
            raise _late_gradient(runtime, late)


def _check_trainable_set(runtimes: list[UnitRuntime]) -> None:
    """[Note: the trainable set is fixed at setup] in engine/shard/flat_group.py."""
    changed = [name for runtime in runtimes for name in runtime.group.requires_grad_changed()]
    if changed:
        shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        raise RequiresGradChangedError(
            f"zero3: `requires_grad` of {shown} changed after zero3 sharded the model; the parameters that "
            "train are fixed when it does (they decide the units, the gradient shards and the optimizer's "
            "shards). Freeze or unfreeze before training starts (in `configure_model`, or a callback's "
            "`setup` such as `BaseFinetuning.freeze_before_training`); to train another set, start a new "
            "run from a checkpoint (unfreezing layers during a fit, as `BackboneFinetuning` does, is not "
            "supported)."
        )


def _eager(hook: Callable) -> Callable:
    """``hook`` run as Python, never traced by ``torch.compile``: see [Note: hooks under torch.compile]."""
    return torch.compiler.disable(hook, recursive=True)


def _tensors_in(output: Any) -> list[torch.Tensor]:
    """Every tensor inside a (nested) structure: tensors, lists, tuples, dicts."""
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


def _replace_tensors(item: Any, swap: dict[int, torch.Tensor]) -> Any:
    """``item`` with every tensor whose id is in ``swap`` replaced (lists, tuples, named tuples, dicts)."""
    if isinstance(item, torch.Tensor):
        return swap.get(id(item), item)
    if isinstance(item, list):
        return [_replace_tensors(x, swap) for x in item]
    if isinstance(item, tuple):
        values = [_replace_tensors(x, swap) for x in item]
        return type(item)(*values) if hasattr(item, "_fields") else tuple(values)
    if isinstance(item, dict):
        return type(item)((k, _replace_tensors(v, swap)) for k, v in item.items())
    return item
