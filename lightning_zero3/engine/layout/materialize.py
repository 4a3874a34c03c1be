"""Sharded initialisation: a model built on the meta device becomes shards, one unit at a time.

[Note: sharded initialisation]
A model created under ``torch.device("meta")`` has shapes and dtypes but no memory. The engine plans
its units on the meta parameters as on real ones, then builds each unit's flat group in turn:

1. the unit's meta parameters become views into one fresh flat buffer (``torch.utils.swap_tensors``
   keeps every ``nn.Parameter`` the same Python object, so tied weights and later references hold);
   other meta parameters of the same modules (small, *persistent* ones) get buffers of their own;
2. on rank 0 only, each module that owns one of them is initialised: by replaying its construction (see
   [Note: eager construction replayed]), or, where that did not set it, by its ``reset_parameters()`` (torch's
   convention, which FSDP2 and Lightning follow: a module initialises its own direct parameters), then
   the initialiser of the library the module comes from (``initialisers.py``: Hugging Face's
   ``_init_weights``, peft's LoRA reset), then the ``init_fn(module)`` the caller passes (a model's
   custom init, such as GPT's ``std=0.02``). A module whose every meta tensor will be read from a
   checkpoint is not initialised (see [Note: loading straight into shards] in sources.py);
3. the flat buffer is broadcast from rank 0 (so every rank agrees, whatever its random state), each rank
   keeps its slice, and the unit is released before the next one is built.

So no rank ever holds more than about one unit in full (the flat buffer and its gathered copy). Buffers
(``register_buffer``) are small: a module that holds meta buffers is materialised whole up front, buffers
zero-filled and then initialised the same way, and broadcast with the other buffers.

[Note: only parameters on the meta device]
A buffer computed in ``__init__`` (a rotary embedding's ``inv_freq``, a causal mask, a custom model's
scale table) is not learned and usually not in any checkpoint: built under ``torch.device("meta")`` it
has no values, and no initialiser knows how to recompute it (a custom model's own ``__init__`` code is
the only place that says). So the strategy builds models under ``parameters_on_meta()``, as Hugging
Face's loader and accelerate's ``init_empty_weights`` do: every parameter is moved to the meta device
the moment it is registered, before the module's ``__init__`` goes on to initialise it (so
``reset_parameters()`` in ``__init__`` is a no-op, and ``torch.empty`` never touched the memory it
reserved), while everything else ``__init__`` computes, buffers included, is real.

[Note: eager construction replayed]
A seeded run must start from the weights an eager build (DDP's) draws. Eager construction draws in the
order the constructors run: each ``nn.Linear`` draws in its own ``__init__`` (``reset_parameters()``),
then a parent's own init (GPT's ``self.apply(init)``, Hugging Face's ``post_init``, post-order) draws
again, all from one generator. Units are built in another order, and later, so drawing at build time
cannot give the same numbers. Instead ``parameters_on_meta()`` records the construction (``_Recorder``,
a dispatch mode):
- every in-place op on a meta parameter (or a view of it) is kept with its arguments, in order, and a
  random one with its generator's state just before it (``Construction``, attached to the parameter);
- every random op on a meta tensor is also run on a scratch tensor of the same shape, strides, dtype and
  the device eager would have used, freed at once: the generator advances exactly as in eager
  construction, on every rank (as under DDP, where every rank builds the model). So a parameter created
  with ``nn.Parameter(torch.randn(...))`` later in ``__init__`` draws eager's numbers, and so does any
  draw after construction (dropout, data): every rank's generator ends where DDP's does;
- a parameter whose value ``__init__`` computed before registering it (``torch.randn``, ``torch.ones``;
  anything but an ``empty`` allocation) keeps that value on rank 0 until its unit is built (so a model
  made only of such parameters is held whole on rank 0 until then: the one exception to one unit at a
  time); ``torch.empty`` parameters (every ``nn.Linear``'s) keep nothing.
When a unit is built, rank 0 copies the kept value and re-runs the recorded ops into the unit's flat
buffer, each random op from its saved state (restored after), so any unit order gives eager's values:
tied weights included (the ops reach the surviving parameter through whichever module touched it; the
head's own ``reset_parameters()`` draws on its discarded weight still advance the generator). The cost:
init runs twice on rank 0 (scratch at construction, replay at build) and once on the others, and a
random op keeps its generator state (5 KB on CPU) until its unit is built. Modules so built are not
given ``reset_parameters()``, their library's initialiser nor ``init_fn``: their construction was their
init. Where a parameter cannot be replayed (an op reading another meta tensor, such as
``weight.copy_(other_meta)`` or ``orthogonal_``, which draws into a scratch matrix) or ``__init__`` left
it unset, its module falls back to those initialisers, with a warning when eager's values are lost.
Fallback draws come from a stream of their own (``side_stream``), so every rank's generator still ends
in the same state. Models built under a plain ``torch.device("meta")`` record nothing: all fallback.
Where equality cannot hold, unseen: an init function that returns early on a meta tensor (torch 2.13's
``nn.init.trunc_normal_``, a rejection sampler) records and draws nothing, so that parameter keeps its
earlier values and every later draw is off eager's stream; and an op reading a real tensor that
``__init__`` changes in place afterwards replays with the changed values.

[Note: draws wait for a load]
A checkpoint overwrites what construction drew, so drawing it is pure cost (all of a model's numbers, on
every rank), and it leaves the generator where ``from_pretrained``, which draws nothing for what it loads,
does not. So construction's random ops on meta tensors are recorded at once but drawn later, in their
order (``_Draw``): when construction draws on a real tensor (eager's order is kept), when the recording
block ends, or when ``load_pretrained`` claims the model inside the block (``draws_settled``): then the
draws that write only into tensors the checkpoint holds are never made, nor recorded for a replay (the
engine fills those from the file); a Hugging Face model's tensors the checkpoint lacks are initialised as
``from_pretrained`` initialises them (``pretrained/missing.py``, recorded and drawn then); every other
waiting draw is made, in order. So a complete checkpoint costs no draw at all, and every rank's generator
ends where it does after ``from_pretrained`` (and peft's ``get_peft_model`` after it). The draws of a
parameter are *decided* once made or skipped; a load outside the block finds them made (correct, but
paid for: ``load_pretrained`` says so). What ``__init__`` draws on a real tensor (a value it computes,
such as ``nn.Parameter(torch.randn(n))``) is drawn there, eager's order kept; ``from_pretrained`` draws
nothing there, so ``pretrained/build.py`` builds such models wholly on the meta device, unrecorded
(``built_whole_on_meta``), and gives their parameters empty records (``adopt``) whose draws wait the same
way. Not seen while draws wait: reading the generator's state directly (``torch.get_rng_state()``,
``fork_rng``) inside the block, which no dispatch reaches.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Callable, Collection, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from ..memory.buffers import host_buffer, return_free_heap
from .initialisers import library_initialisers

InitFn = Callable[[nn.Module], None]
SCRATCH_MAPPED = 1 << 20  # host scratch of at least this many bytes is a memory map of its own
CONSTRUCTION = "_zero3_construction"  # the attribute a recorded meta parameter carries its Construction in


_recorder: Optional[_Recorder] = None  # the one recording now (blocks may nest: one records)


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside the block get their parameters on the meta device and everything else on
    the current device (see [Note: only parameters on the meta device]); their construction is recorded
    for rank 0 to replay (see [Note: eager construction replayed])."""
    global _recorder
    if _recorder is not None:  # nested in another block, which records
        yield
        return
    register = nn.Module.register_parameter
    recorder = _Recorder()

    def register_on_meta(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            with torch.no_grad():
                meta = param.data.to("meta")
            module._parameters[name] = type(param)(meta, requires_grad=param.requires_grad)
            recorder.register(param.data, module._parameters[name])

    nn.Module.register_parameter = register_on_meta
    _recorder = recorder
    try:
        with recorder:
            yield
        recorder.draw_waiting()  # no load claimed them: every rank's generator ends where eager's does
    finally:
        nn.Module.register_parameter = register
        _recorder = None
        recorder.params.clear()
        # the scratch draws are freed, but glibc's heap keeps them resident (a whole MoE layer's experts),
        # a floor under every later phase: a phase ends here
        return_free_heap()


def recording() -> bool:
    """Whether a ``parameters_on_meta()`` block is open (a model is being built for zero3 to shard)."""
    return _recorder is not None


@contextmanager
def built_whole_on_meta() -> Iterator[None]:
    """Inside a ``parameters_on_meta()`` block: what the block builds has every tensor on the meta device,
    buffers too, and nothing of it is recorded or drawn (as ``from_pretrained`` builds); ``adopt`` then
    gives its parameters records for what initialises them later."""
    assert _recorder is not None, "built_whole_on_meta() belongs inside parameters_on_meta()"
    _recorder.paused = True
    try:
        with torch.device("meta"):
            yield
    finally:
        _recorder.paused = False


def adopt(module: nn.Module) -> None:
    """Give ``module``'s meta parameters that have none an empty construction record in the open recording:
    their draws wait for a load ([Note: draws wait for a load]), and what runs on them is recorded."""
    assert _recorder is not None, "adopt() belongs inside parameters_on_meta()"
    for p in module.parameters():
        if p.is_meta and getattr(p, CONSTRUCTION, None) is None:
            _recorder.track(p, Construction(_recorder.device, p.dtype, None))


def undecided(param: nn.Parameter) -> bool:
    """Whether ``param`` is being built on the meta device and its construction's draws still wait (see
    [Note: draws wait for a load])."""
    record = getattr(param, CONSTRUCTION, None)
    return record is not None and not record.decided


@contextmanager
def draws_settled(loaded: Iterable[nn.Parameter], fresh: Iterable[nn.Parameter] = ()) -> Iterator[None]:
    """Settle the waiting draws of a model being built (see [Note: draws wait for a load]): those of the
    ``loaded`` parameters (a checkpoint fills them) and of the ``fresh`` ones are never made; what the block
    does to the ``fresh`` ones is recorded instead of their construction (a library's own rule for what a
    checkpoint lacks, drawn here); after the block every other waiting draw is made, in order."""
    loaded, fresh = [p for p in loaded if undecided(p)], [p for p in fresh if undecided(p)]
    records = {id(r): r for r in (getattr(p, CONSTRUCTION) for p in (*loaded, *fresh))}
    assert _recorder is not None or not records, "undecided draws outlive their recording"
    for p in loaded:
        getattr(p, CONSTRUCTION).value = None  # read from the checkpoint: the value computed in __init__ is not
    for p in fresh:
        getattr(p, CONSTRUCTION).restart()
    if _recorder is not None:
        _recorder.skip_draws(records.keys())
    yield
    if _recorder is not None:
        _recorder.draw_waiting()


def drawn_elements(params: Iterable[nn.Parameter]) -> int:
    """How many random numbers construction drew for ``params`` (meta parameters whose draws were made)."""
    total = 0
    for p in params:
        record = getattr(p, CONSTRUCTION, None)
        if record is not None and record.decided and any(op[-2] is not None and op[-1] is not None for op in record.ops):
            total += p.numel()
    return total


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in _tensors(module))


def move_real_tensors(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)`` for every tensor that has memory; meta tensors stay for the engine to build."""
    with torch.no_grad():
        for owner in module.modules():
            for store in (owner._parameters, owner._buffers):
                for name, tensor in store.items():
                    if tensor is not None and not tensor.is_meta and tensor.device != device:
                        if isinstance(tensor, nn.Parameter):
                            tensor.data = tensor.data.to(device)
                        else:
                            store[name] = tensor.to(device)


class Materializer:
    """Turns meta parameters into real ones, unit by unit (see [Note: sharded initialisation])."""

    def __init__(
        self, root: nn.Module, device: torch.device, init_fn: Optional[InitFn], is_source: bool,
        loaded_params: Collection[int] = (), loaded_buffers: Collection[tuple[int, str]] = (),
    ) -> None:  # fmt: skip
        self.device = device
        self.init_fn = init_fn
        self.is_source = is_source  # only the source rank (0) runs the initialisers; the rest receive
        # tensors whose values come from a checkpoint: parameters by id, buffers by (id of module, name)
        self.loaded_params = set(loaded_params)
        self.loaded_buffers = set(loaded_buffers)
        self.library_inits = library_initialisers(root)
        self._fallback_stream: dict = {}  # the initialisers' own random stream (see side_stream)
        self.owners: dict[int, list[nn.Module]] = {}  # id(parameter) -> modules holding it directly
        for module in root.modules():
            for p in module._parameters.values():
                if p is not None:
                    self.owners.setdefault(id(p), []).append(module)
        self._done: set[int] = set()
        with torch.no_grad():
            for module in root.modules():
                if any(b is not None and b.is_meta for b in module._buffers.values()):
                    self._materialize_modules([module], {})

    def fill(self, named_params: list[tuple[str, nn.Parameter]], master: torch.Tensor) -> None:
        """Make ``named_params`` real, laid out flat in ``master`` (on the source rank: initialised)."""
        views, offset = {}, 0
        for _, p in named_params:
            views[id(p)] = master[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
        modules = {id(m): m for _, p in named_params if p.is_meta for m in self.owners.get(id(p), [])}
        with torch.no_grad():
            self._materialize_modules(list(modules.values()), views)
            for _, p in named_params:  # parameters that were real already (or made so by an earlier unit)
                target = views[id(p)]
                if p.data_ptr() != target.data_ptr():
                    target.copy_(p.detach())

    def _materialize_modules(self, modules: Iterable[nn.Module], views: dict[int, torch.Tensor]) -> None:
        fresh = [m for m in modules if id(m) not in self._done]
        # what construction did to each parameter built now ([Note: eager construction replayed])
        records: dict[int, Optional[Construction]] = {}
        for module in fresh:
            for p in module._parameters.values():
                if p is not None and p.is_meta and id(p) not in records:
                    records[id(p)] = p.__dict__.pop(CONSTRUCTION, None)  # before the swap moves __dict__
        to_initialise = [m for m in fresh if not self._all_loaded(m) and not self._constructed(m, records)]
        replays = []
        for module in fresh:
            self._done.add(id(module))
            for p in module._parameters.values():
                if p is not None and p.is_meta:
                    data = views.get(id(p))
                    if data is None:
                        data = torch.empty(p.shape, dtype=p.dtype, device=self.device)
                    # a fresh, empty parameter first, then ``.data``: the parameter keeps a version
                    # counter of its own, as one built whole does, instead of sharing the flat buffer's
                    # (which every later gather bumps, and autograd would take for an in-place change)
                    empty = nn.Parameter(torch.empty(0, dtype=p.dtype, device=self.device), p.requires_grad)
                    torch.utils.swap_tensors(p, empty)
                    p.data = data
                    record = records.get(id(p))
                    if record is not None and record.sets_values and id(p) not in self.loaded_params:
                        replays.append((record, p))
            for name, b in module._buffers.items():
                if b is not None and b.is_meta:
                    module._buffers[name] = torch.zeros(b.shape, dtype=b.dtype, device=self.device)
        if not self.is_source:
            return
        if to_initialise:
            with side_stream(self._fallback_stream):  # leaves the live generator where construction left it
                for module in to_initialise:
                    reset = getattr(module, "reset_parameters", None)
                    if callable(reset):
                        reset()
                for initialise in self.library_inits:
                    initialise(to_initialise)
                if self.init_fn is not None:
                    for module in to_initialise:
                        self.init_fn(module)
        for record, p in replays:  # after the fallback, which may have written a replayable neighbour
            record.replay(p.data)

    def _constructed(self, module: nn.Module, records: dict[int, Optional[Construction]]) -> bool:
        """Whether recorded construction set every parameter of ``module`` built now; warns where a
        recorded parameter cannot be replayed (its module falls back to the initialisers)."""
        built = [(n, p) for n, p in module._parameters.items() if p is not None and id(p) in records]
        needed = [(n, records[id(p)]) for n, p in built if id(p) not in self.loaded_params]
        for name, record in needed:
            if self.is_source and record is not None and record.problem is not None:
                warnings.warn(
                    f"zero3: {type(module).__name__}.{name} cannot be given the values an eager build gives it "
                    f"({record.problem}): its module is initialised by reset_parameters(), its library's "
                    "initialiser and init_fn instead, so a seeded run starts from other weights than DDP's.",
                    stacklevel=2,
                )
        return bool(needed) and all(record is not None and record.sets_values for _, record in needed)

    def _all_loaded(self, module: nn.Module) -> bool:
        """Whether every meta tensor ``module`` holds directly will be read from a checkpoint."""
        meta_params = [p for p in module._parameters.values() if p is not None and p.is_meta]
        meta_buffers = [name for name, b in module._buffers.items() if b is not None and b.is_meta]
        if not meta_params and not meta_buffers:
            return False
        return all(id(p) in self.loaded_params for p in meta_params) and all(
            (id(module), name) in self.loaded_buffers for name in meta_buffers
        )

    def check_done(self, root: nn.Module) -> None:
        left = [name for name, t in _named_tensors(root) if t.is_meta]
        if left:
            raise RuntimeError(f"zero3: tensors still on the meta device after sharded initialisation: {left[:5]}")


def _tensors(module: nn.Module):
    return (t for _, t in _named_tensors(module))


def _named_tensors(module: nn.Module):
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


# -- recording eager construction ([Note: eager construction replayed]) ------------------------------

_EMPTY = {
    torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default, torch.ops.aten.empty_like.default,
    torch.ops.aten.new_empty.default, torch.ops.aten.new_empty_strided.default,
}  # fmt: skip


class _Alias:
    """A recorded op's view of the parameter it writes: size, stride and offset into its storage."""

    def __init__(self, t: torch.Tensor) -> None:
        self.size, self.stride, self.offset = tuple(t.size()), tuple(t.stride()), t.storage_offset()

    def on(self, target: torch.Tensor) -> torch.Tensor:
        return target.as_strided(self.size, self.stride, target.storage_offset() + self.offset)


class Construction:
    """What eager construction did to one parameter: its value at registration (kept on rank 0 when
    ``__init__`` computed one) and the in-place ops on it since, random ones with their generator state."""

    def __init__(self, device: torch.device, dtype: torch.dtype, value: Optional[torch.Tensor]) -> None:
        self.device, self.dtype, self.value = device, dtype, value
        # [op, args, kwargs, generator or None, its state before the op (set when the draw is made)]
        self.ops: list[list] = []
        self.problem: Optional[str] = None  # why it cannot be replayed
        self.layout_problem: Optional[str] = None  # the part of ``problem`` no later init can lift
        self.decided = False  # whether its construction's draws were made or skipped ([Note: draws wait for a load])

    def restart(self) -> None:
        """Forget what construction did after registration: the parameter is initialised afresh by the ops
        recorded next (a library's rule for a tensor a checkpoint lacks)."""
        self.ops, self.problem = [], self.layout_problem

    @property
    def sets_values(self) -> bool:
        return self.problem is None and (self.value is not None or bool(self.ops))

    def replay(self, real: torch.Tensor) -> None:
        """Give ``real`` the values eager construction gave this parameter (on its device and dtype)."""
        same = real.device == self.device and real.dtype == self.dtype and real.is_contiguous()
        target = real if same else torch.empty(real.shape, dtype=self.dtype, device=self.device)
        if self.value is not None:
            target.copy_(self.value)
        for op, args, kwargs, generator, state in self.ops:
            args, kwargs = tree_map(lambda a: a.on(target) if isinstance(a, _Alias) else a, (args, kwargs))
            if generator is None:
                op(*args, **kwargs)
                continue
            assert state is not None, "a recorded draw was skipped, yet its parameter is being built from it"
            live = generator.get_state()
            generator.set_state(state)
            try:
                op(*args, **kwargs)
            finally:
                generator.set_state(live)
        if target is not real:
            real.copy_(target)


class _Recorder(TorchDispatchMode):
    """Records what construction does to meta parameters, and draws its random numbers on scratch tensors."""

    def __init__(self) -> None:
        super().__init__()
        # only the source rank replays: the others keep no values (states are small, kept everywhere)
        self.keep_values = not (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0)
        self.device = torch.get_default_device()
        self.params: dict[int, tuple[nn.Parameter, Construction]] = {}  # storage -> (meta param, record)
        self.unset: set[int] = set()  # storages allocated empty and not written since (real tensors)
        self.waiting: list[_Draw] = []  # draws on meta tensors not made yet, in construction order
        self.drawing = False  # making the waiting draws: their scratch ops pass straight through
        self.paused = False  # inside built_whole_on_meta(): nothing is recorded

    def register(self, data: torch.Tensor, meta: nn.Parameter) -> None:
        defined = _storage(data) not in self.unset and data.is_contiguous()
        self.track(meta, Construction(data.device, data.dtype, data.detach() if defined and self.keep_values else None))

    def track(self, meta: nn.Parameter, record: Construction) -> None:
        if not meta.is_contiguous() or meta.storage_offset() != 0:
            record.problem = record.layout_problem = "its storage is not laid out as one contiguous tensor"
        setattr(meta, CONSTRUCTION, record)
        self.params[_storage(meta)] = (meta, record)  # kept alive while recording: its storage id stays its own

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.drawing or self.paused:
            return func(*args, **kwargs)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        random = torch.Tag.nondeterministic_seeded in func.tags
        if not any(t.is_meta for t in tensors):
            if random:  # a draw of its own: the waiting ones come first, as in eager construction
                self.draw_waiting()
            out = func(*args, **kwargs)
            self._note_values(func, args, kwargs, out)
            return out
        generator = draw = None
        if random:
            generator = kwargs.get("generator") or _default_generator(self._draw_device(_first_meta(args, kwargs)))
            draw = _Draw(self, func, args, kwargs, generator)
            self.waiting.append(draw)
        out = func(*args, **kwargs)
        for written in _written(func, args, kwargs):
            entry = self.params.get(_storage(written)) if written.is_meta else None
            if entry is None:
                continue
            record = entry[1]
            others = [t for t in tensors if t.is_meta and _storage(t) != _storage(written)]
            if others:
                record.problem = f"`{func}` writes it from another meta tensor"
            elif record.problem is None:
                spec = tree_map(lambda a: _Alias(a) if isinstance(a, torch.Tensor) and a.is_meta else a, (args, kwargs))
                op = [func, *spec, generator, None]
                record.ops.append(op)
                if draw is not None:
                    draw.writes.append((record, op))
        return out

    def skip_draws(self, records: Collection[int]) -> None:
        """Drop the waiting draws that write only into the parameters whose records ``records`` names (by id)."""
        self.waiting = [d for d in self.waiting if not (d.writes and all(id(r) in records for r, _ in d.writes))]

    def draw_waiting(self) -> None:
        """Make the waiting draws in order (eager's numbers, on scratch); every parameter recorded so far is
        then decided."""
        waiting, self.waiting = self.waiting, []
        self.drawing = True
        try:
            for draw in waiting:
                draw.make()
        finally:
            self.drawing = False
        for _, record in self.params.values():
            record.decided = True

    def _draw_device(self, a: torch.Tensor) -> torch.device:
        """The device eager construction would have drawn ``a`` on."""
        entry = self.params.get(_storage(a))
        return entry[1].device if entry is not None else self.device

    def _scratch(self, a):
        if not (isinstance(a, torch.Tensor) and a.is_meta):
            return a
        device = self._draw_device(a)
        span = 1 + sum((n - 1) * s for n, s in zip(a.size(), a.stride())) if a.numel() else 0
        if device.type == "cpu" and span * a.element_size() >= SCRATCH_MAPPED:
            # a map of its own, unmapped when the draw is done: from glibc's heap, the freed scratch of
            # earlier layers would stay resident while the next are built
            return host_buffer(span, a.dtype).as_strided(a.size(), a.stride())
        return torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device=device)

    def _note_values(self, func, args, kwargs, out) -> None:
        """Which real storages hold no values yet: allocated by an ``empty`` op, not written since."""
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if func in _EMPTY:
            self.unset.update(_storage(t) for t in outs)
            return
        for t in _written(func, args, kwargs):
            self.unset.discard(_storage(t))
        if not func.is_view:  # fresh memory, perhaps where an empty tensor was freed
            for t in outs:
                self.unset.discard(_storage(t))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors ``func`` writes into (in-place and ``out=`` arguments)."""
    found = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            found.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return found


def _first_meta(args, kwargs) -> torch.Tensor:
    return next(t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_meta)


class _Draw:
    """A random op of construction on a meta tensor, waiting to be drawn on a scratch tensor (see [Note: draws
    wait for a load]); ``writes``: the records (and their op entries) of the parameters it writes into."""

    def __init__(self, recorder: _Recorder, func, args, kwargs, generator: torch.Generator) -> None:
        self.recorder, self.func, self.args, self.kwargs, self.generator = recorder, func, args, kwargs, generator
        self.writes: list[tuple[Construction, list]] = []

    def make(self) -> None:
        state = self.generator.get_state()
        for _, op in self.writes:
            op[-1] = state
        scratch_args, scratch_kwargs = tree_map(self.recorder._scratch, (self.args, self.kwargs))
        self.func(*scratch_args, **scratch_kwargs)  # eager's draws, into memory freed at once


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type)
    return module.default_generators[device.index if device.index is not None else module.current_device()]


@contextmanager
def side_stream(state: dict) -> Iterator[None]:
    """Draws in the block come from a stream of their own (kept in ``state`` from one block to the next,
    starting from the live one), and leave the live generators as they were."""
    gens = [torch.default_generator]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gens.extend(torch.cuda.default_generators)
    live = [g.get_state() for g in gens]
    for g, saved in zip(gens, state.get("states", [])):
        g.set_state(saved)
    try:
        yield
    finally:
        state["states"] = [g.get_state() for g in gens]
        for g, saved in zip(gens, live):
            g.set_state(saved)
