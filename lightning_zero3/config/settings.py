"""The knobs of zero3, in one validated dataclass.

Every knob is documented where it is declared. ``Zero3Config.from_kwargs`` is the single door through
which user settings enter (the strategy's ``**kwargs``, later YAML configs): unknown names and
out-of-range values fail here, before any process group or model is touched, with a message that
names the setting and the fix.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum
from typing import Any, Callable, Optional, Union

from torch import nn

from ..errors import Zero3ConfigError
from .deepspeed import merge, translate
from .precision_flags import DTYPES

#: What ``unit_modules`` accepts: module classes, class names (``"Block"`` or ``"pkg.mod.Block"``), or a
#: callable ``(module) -> bool`` that says whether a module is its own unit.
UnitPolicy = Union[None, Callable[[nn.Module], bool], "list[Union[type, str]]", "tuple[Union[type, str], ...]"]

_BACKENDS = (None, "gloo", "nccl", "mpi", "ucc", "xccl", "hccl")



@dataclass(frozen=True)
class Zero3Config:
    """Settings of the zero3 strategy. Defaults follow DeepSpeed ZeRO-3 where a DeepSpeed knob exists."""

    persistence_threshold: int = 100_000
    """Parameters with fewer elements than this are not sharded: every rank keeps them whole (their
    gradients and optimizer state are still sharded). Gathering many tiny tensors costs more in
    latency than it saves in memory. DeepSpeed: ``stage3_param_persistence_threshold``. 0 shards all."""

    unit_modules: UnitPolicy = None
    """Which modules become units (gathered and released together). ``None``: automatic, each member
    of a ``ModuleList``/``Sequential`` whose members repeat a class (transformer blocks) is a unit and
    everything else belongs to the root unit. Otherwise a list of module classes or class names, or a
    callable ``module -> bool``."""

    prefetch_bucket_size: int = 50_000_000
    """Elements gathered ahead of use: when a unit starts forward (or backward), the next units in the
    recorded execution order are all-gathered asynchronously while it computes, up to this many
    elements (at most two gathers in flight). 0 turns prefetch off. DeepSpeed: ``stage3_prefetch_bucket_size``."""

    max_live_parameters: int = 1_000_000_000
    """Most elements of full (gathered) parameters alive at once; prefetch stops short of it.
    DeepSpeed: ``stage3_max_live_parameters``."""

    max_reuse_distance: int = 0
    """A unit stays gathered from its forward to its backward when the units gathered in between hold at
    most this many elements: 0 keeps just the last unit (its backward comes right after its forward),
    larger values trade memory for fewer all-gathers. DeepSpeed: ``stage3_max_reuse_distance``."""

    reduce_bucket_size: int = 1_000_000
    """Units smaller than this many elements are *small*: their gradients are reduce-scattered together,
    one collective per bucket of this size, and the small units gathered at one time (a unit and its
    prefetches) share one all-gather: fewer, larger messages. Larger units go alone, their gradients as
    soon as their backward ends, overlapped with the rest of it. DeepSpeed's ``reduce_bucket_size`` defaults to 5e8, which
    would hold every gradient of a smaller model until backward ends; 1e6 keeps the overlap."""

    overlap_comm: bool = True
    """Run prefetch all-gathers and gradient reduce-scatters asynchronously, overlapped with compute
    (at most two reduce-scatters in flight). False: every collective completes before compute goes on."""

    tune_collectives: bool = True
    """At start-up, time each way of doing the all-gather and the reduce-scatter at the sizes this model
    uses, on this job's process group, and use the fastest (see ``engine/comm/communicator.py``)."""

    single_process_sharding: bool = False
    """One process (world size 1) has nothing to shard. ``False``: unless parameters are offloaded, every
    unit stays gathered for the whole run, with no all-gather, release or re-gather (as torch FSDP1
    switches to no-shard); under ``32-true`` and the ``*-true`` flags the optimizer steps the very buffer the
    model computes with (one copy of the weights), under ``*-mixed`` the compute-dtype copy is cast again
    once per optimizer step. ``True``: one process gathers and releases each unit as several ranks do
    (it saves that compute-dtype copy under ``*-mixed``, at a gather and a release per unit per pass)."""

    secondary_shard_size: Optional[Union[int, str]] = None
    """Node-local secondary shards (ZeRO++ hpZ): after a unit's forward, each rank keeps its share of the
    unit's parameters within its group of this many consecutive ranks, and backward re-gathers the unit
    from those shares over that group instead of over all ranks. ``"node"``: the ranks of one node (the
    Trainer's ``devices``), so backward's gathers never cross a node boundary. Must divide the number of
    ranks. Costs about 1/size of the units alive between their forward and backward (``memory_report``:
    ``secondary_shards``). ``None``: off. DeepSpeed: ``zero_hpz_partition_size``."""

    quantize_gathers: Optional[str] = None
    """``"int8"``: units are all-gathered as int8 blocks of 256 elements with an fp32 scale each (about
    0.25x the bytes of fp32, 0.51x of bf16) and dequantized into the compute dtype; masters, gradients
    and optimizer state stay in full precision. Persistent (small) parameters and gathers from secondary
    shards are not quantized. ``None``: gathers in the compute dtype. DeepSpeed: ``zero_quantized_weights``."""

    cpu_threads: Optional[int] = None
    """Compute threads per rank on CPU (``torch.set_num_threads``). None: the cores this rank may run on
    divided by the ranks of the job that share them on this machine (however many nodes the launcher
    says it has; see ``frontends/cpu_threads.py``), at least one, so ranks do not oversubscribe the cores."""

    reduce_dtype: Optional[str] = None
    """Dtype gradients are reduce-scattered in: ``"fp32"``, ``"bf16"`` or ``"fp16"``. ``None``: fp32 under
    ``32-true`` and the ``*-mixed`` flags (gradients accumulate in fp32 shards either way), the
    parameters' dtype under ``*-true``. Under ``bf16-mixed``, ``"bf16"`` halves the bytes reduced."""

    sync_module_states: bool = True
    """Broadcast rank 0's parameters and buffers before sharding, as DDP does, so ranks that
    initialised differently still start from one model."""

    process_group_backend: Optional[str] = None
    """``torch.distributed`` backend; ``None`` picks nccl on CUDA and gloo on CPU."""

    timeout: timedelta = field(default_factory=lambda: timedelta(minutes=30))
    """How long a collective may wait for the other ranks before every rank fails with an error."""

    hang_timeout: Optional[Union[timedelta, float]] = field(default_factory=lambda: timedelta(seconds=20))
    """How long a rank waits in a collective that the other ranks provably cannot join (they wait in
    different collectives: ``trainer.save_checkpoint`` or ``save_full_weights`` called on one rank only)
    before every rank stops with one message naming what each rank was doing and what to do. Every rank
    is then gone within about ``hang_timeout`` + 3 polls (under 40 s by default). Ranks waiting in the same
    collective are never stopped, however slow it is. A ``timedelta`` or seconds; ``None``: off (the
    collective waits for ``timeout``)."""

    hang_idle_timeout: Optional[Union[timedelta, float]] = field(default_factory=lambda: timedelta(minutes=5))
    """How long a rank that waits in a collective (past ``hang_timeout``) waits for a peer that issues no
    collective at all and shows no progress, outside any phase the waiting rank is in (code that runs on
    one rank only: a loop, a long rank-0-only evaluation), before every rank stops with the same message.
    Raise it for long work on some ranks between collectives. A ``timedelta`` or seconds; ``None``: wait
    for ``timeout``."""

    inference_memory_budget: Union[int, str, None] = "auto"
    """Evaluation (``validate`` / ``test`` / ``predict``, or forward calls with gradients off): bytes of
    gathered units that may stay gathered across forward calls, so a model called many times (generation:
    once per token) is not all-gathered again for every call. Bytes, or a string such as ``"2GB"`` /
    ``"512MiB"``; ``0`` gathers every unit for every call (as a training step does); ``"auto"``: what a
    training step holds on top of the shards (its gathered units and gradient staging buffers, measured
    when this model has trained), less the streaming window evaluation keeps for the other units, so
    evaluation never holds more than a training step did. Which units stay is chosen from a profile of the
    first calls (see ``engine/schedule/residency.py``); leaving the stage releases them."""

    unshard_after_fit: bool = False
    """After ``trainer.fit`` the module stays sharded and attached to its engine, as with torch FSDP and
    DeepSpeed: ``validate`` / ``test`` / ``predict``, a later ``fit`` (same Trainer or a new one),
    ``trainer.save_checkpoint`` and forward calls on every rank run on the trained shards, and no rank
    ever holds the whole model or its optimizer state (``lightning_zero3.save_full_weights`` streams full
    weights to a file). True: when ``fit`` ends, the full model is gathered on every rank, the module holds
    ordinary full weights again and the optimizer its full, unsharded state, as after DDP (for models that
    fit in one process's memory; ``lightning_zero3.unshard(module)`` does the same at any time)."""

    checkpoint_format: str = "sharded"
    """What ``trainer.save_checkpoint`` / ``ModelCheckpoint`` write. ``"sharded"``: a directory in which each
    rank writes its own shards with ``torch.distributed.checkpoint`` (nothing is gathered; loads on any
    number of ranks; ``lightning_zero3.checkpoint.consolidate`` makes one file of it). ``"full"``: one
    ``torch.save`` file of full weights and unsharded optimizer state, gathered on every rank (loadable
    by DDP as it is; needs the full model in memory). Loading takes either, whatever this setting."""

    save_non_finite: bool = False
    """False: a sharded save whose model or optimizer state holds NaN or inf is refused with a
    ``NonFiniteCheckpointError`` naming the first such tensor and the step (nothing is written, so
    ``last.ckpt`` is never silently replaced by a diverged state). True: such states are saved as they are
    (to inspect a divergence). The check runs on the bytes as they are written, adding no read."""

    offload_optimizer: Optional[str] = None
    """Where the fp32 master shards and the optimizer state live: ``None`` (the training device),
    ``"cpu"`` (host memory; the optimizer steps on the host) or ``"nvme"`` (files under ``nvme_path``,
    streamed through host buffers one group at a time; gradient shards wait there too between backward
    and the step); ``"auto"``: the lightest plan that fits ``memory_budget``, chosen at setup from the
    estimate (see ``docs/will-it-fit.md``). DeepSpeed: ``offload_optimizer.device``."""

    offload_params: Optional[str] = None
    """Where parameter shards live between uses: ``None`` (the training device), ``"cpu"`` or ``"nvme"``.
    Needs ``offload_optimizer`` at the same tier or deeper (the optimizer steps the shards where it keeps
    them): ``"cpu"`` goes with ``offload_optimizer="cpu"`` or ``"nvme"``, ``"nvme"`` with ``"nvme"``.
    ``"auto"``: chosen with the optimizer's tier to fit ``memory_budget``. DeepSpeed: ``offload_param.device``."""

    memory_budget: Union[int, str, None] = None
    """Bytes per rank that the automatic plan (an offload setting ``"auto"``) must fit: bytes or a string such
    as ``"2GB"``; ``"auto"`` (or None): the device's free memory at setup less 10% (on CPU: the host's
    available memory divided by this node's ranks). At setup the engine estimates each plan with what it
    measures (this process's resident memory so far, the first step's activations on the meta device) and
    takes the lightest that fits, sizing ``offload_buffer_count`` and prefetch to it; if none fits it fails
    before any weight is placed, with the figures. While training the budget holds at every step boundary:
    a step that comes near it makes the next steps keep fewer buffers (see ``engine/plan/dynamic.py``), and
    one more than 5% over it with nothing left to change ends the run with ``StepOverBudgetError``. On CPU the figure is
    the rank's whole resident memory. Ignored when neither offload setting is ``"auto"``."""

    nvme_path: Optional[str] = None
    """Directory for NVMe swap files (required when either offload setting is ``"nvme"``; the registered
    name ``"zero3_offload_nvme"`` defaults it to ``default_nvme_path()``, the system temp directory). The
    plugin checks before training that it exists or can be created, is writable and has room, then makes
    a private sub-directory of its own there (0700, files 0600), removed at the end; one left behind by a
    crashed run on this host is removed at the next start.
    DeepSpeed: ``offload_optimizer.nvme_path`` / ``offload_param.nvme_path``."""

    offload_pin_memory: bool = True
    """Use page-locked host buffers for offload when CUDA is present (faster, asynchronous copies).
    Ignored without CUDA. DeepSpeed: ``offload_*.pin_memory``."""

    offload_buffer_count: int = 4
    """How many groups' NVMe-tier shards may be in host memory at once, and the read-ahead depth (at
    least 2: one group is stepped while the next is read and the previous one is written).
    DeepSpeed: ``offload_*.buffer_count``."""

    offload_buffer_size: int = 100_000_000
    """Elements per NVMe read or write request; larger shards are streamed in pieces of this size.
    DeepSpeed: ``offload_param.buffer_size``."""

    def __post_init__(self) -> None:
        _check_int("persistence_threshold", self.persistence_threshold, minimum=0)
        object.__setattr__(self, "persistence_threshold", int(self.persistence_threshold))
        for name in ("prefetch_bucket_size", "max_live_parameters", "max_reuse_distance", "reduce_bucket_size"):
            _check_int(name, getattr(self, name), minimum=0)
            object.__setattr__(self, name, int(getattr(self, name)))
        if self.cpu_threads is not None:
            _check_int("cpu_threads", self.cpu_threads, minimum=1)
        _check_hierarchy(self)
        for name in ("overlap_comm", "tune_collectives", "single_process_sharding", "unshard_after_fit"):
            if not isinstance(getattr(self, name), bool):
                raise Zero3ConfigError(f"zero3: `{name}` must be True or False, got {getattr(self, name)!r}.")
        _check_unit_modules(self.unit_modules)
        if isinstance(self.unit_modules, (type, str, list, set, frozenset)):
            names = [self.unit_modules] if isinstance(self.unit_modules, (type, str)) else self.unit_modules
            object.__setattr__(self, "unit_modules", tuple(names))
        if self.reduce_dtype is not None and self.reduce_dtype not in DTYPES:
            raise Zero3ConfigError(
                f"zero3: `reduce_dtype={self.reduce_dtype!r}` is not a dtype name; use one of {list(DTYPES)} or None."
            )
        if not isinstance(self.sync_module_states, bool):
            raise Zero3ConfigError(
                f"zero3: `sync_module_states` must be True or False, got {self.sync_module_states!r}."
            )
        if self.process_group_backend not in _BACKENDS:
            raise Zero3ConfigError(
                f"zero3: `process_group_backend={self.process_group_backend!r}` is not a torch.distributed "
                f"backend; use one of {[b for b in _BACKENDS if b]} or None to choose by device."
            )
        _check_offload(self)
        try:
            parse_budget(self.inference_memory_budget)
        except ValueError:
            raise Zero3ConfigError(
                f"zero3: `inference_memory_budget={self.inference_memory_budget!r}` is not a budget; give bytes "
                '(an int >= 0, or a string such as "2GB" / "512MiB"), "auto", or 0 to keep nothing gathered.'
            ) from None
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise Zero3ConfigError(
                f"zero3: `checkpoint_format={self.checkpoint_format!r}` is not a checkpoint format; use "
                '"sharded" (each rank writes its shards) or "full" (one file of full state).'
            )
        for name in ("hang_timeout", "hang_idle_timeout"):
            object.__setattr__(self, name, _seconds_setting(name, getattr(self, name)))
        if not isinstance(self.timeout, timedelta) or self.timeout.total_seconds() <= 0:
            raise Zero3ConfigError(
                f"zero3: `timeout` must be a positive datetime.timedelta, got {self.timeout!r}; "
                "for example timeout=datetime.timedelta(minutes=30)."
            )

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_kwargs(cls, config: Optional["Zero3Config"] = None, **kwargs: Any) -> "Zero3Config":
        """Build a config from keyword knobs, on top of ``config`` when one is given."""
        unknown = sorted(set(kwargs) - set(cls.field_names()))
        if unknown:
            raise Zero3ConfigError(
                f"zero3: unknown setting(s) {unknown}. Valid settings are: {', '.join(cls.field_names())}."
            )
        if config is not None and not isinstance(config, Zero3Config):
            raise Zero3ConfigError(f"zero3: `config` must be a Zero3Config, got {type(config).__name__}.")
        base = config if config is not None else cls()
        return dataclasses.replace(base, **kwargs)

    @classmethod
    def from_deepspeed(cls, source: Any, **overrides: Any) -> "Zero3Config":
        """Translate a DeepSpeed config (dict or JSON path; full, or its ``zero_optimization`` block), knob
        by knob; ``overrides`` win. Settings with no meaning here are named in a warning (``deepspeed.py``)."""
        return cls.from_kwargs(**merge(translate(source), overrides))


Budget = Union[int, str, None]


def parse_budget(value: Budget) -> Union[int, str]:
    """``"auto"``, or a number of bytes from an int or a string such as ``"2GB"`` / ``"512MiB"`` (None: 0)."""
    if value is None:
        return 0
    if value == "auto":
        return "auto"
    if isinstance(value, bool):
        raise ValueError(f"{value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"{value!r}")
        return int(value)
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", str(value), flags=re.IGNORECASE)
    if not match:
        raise ValueError(f"{value!r}")
    base = 1024 if match.group(3) else 1000
    power = " KMGT".index(match.group(2).upper() or " ")
    return int(float(match.group(1)) * base**power)


def _seconds_setting(name: str, value: Any) -> Optional[timedelta]:
    """A positive duration (a timedelta, or seconds as a number), or None."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = timedelta(seconds=value)
    if not isinstance(value, timedelta) or value.total_seconds() <= 0:
        raise Zero3ConfigError(
            f"zero3: `{name}` must be a positive duration (a datetime.timedelta, or seconds as a number) or None "
            f"to turn it off, got {value!r}; for example {name}=datetime.timedelta(seconds=20)."
        )
    return value


def _check_int(name: str, value: Any, minimum: int) -> None:
    # floats such as 1e5 are accepted when they are whole numbers, as DeepSpeed configs write them.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise Zero3ConfigError(f"zero3: `{name}` must be a whole number, got {value!r}.")
    if value < minimum:
        raise Zero3ConfigError(f"zero3: `{name}` must be >= {minimum}, got {value!r}.")


def _check_unit_modules(value: Any) -> None:
    if value is None or callable(value) and not isinstance(value, type):
        return
    if isinstance(value, (type, str)):
        value = [value]
    if not isinstance(value, (list, tuple, set, frozenset)) or not value:
        raise Zero3ConfigError(
            "zero3: `unit_modules` must be None (automatic), a non-empty list of module classes or class "
            f"names, or a callable module -> bool; got {value!r}."
        )
    for item in value:
        if isinstance(item, str) and item:
            continue
        if isinstance(item, type) and issubclass(item, nn.Module):
            continue
        raise Zero3ConfigError(
            f"zero3: `unit_modules` entry {item!r} is neither an nn.Module subclass nor a class name."
        )


QUANTIZED_GATHERS = (None, "int8")


def _check_hierarchy(config: "Zero3Config") -> None:
    size = config.secondary_shard_size
    if size is not None and size != "node":
        if isinstance(size, bool) or not isinstance(size, (int, float)) or size != int(size) or size < 1:
            raise Zero3ConfigError(
                f"zero3: `secondary_shard_size` must be None (off), \"node\" (the ranks of one node) or a whole "
                f"number of ranks >= 1 that divides the world size, got {size!r}."
            )
        object.__setattr__(config, "secondary_shard_size", int(size))
    if config.quantize_gathers not in QUANTIZED_GATHERS:
        raise Zero3ConfigError(
            f"zero3: `quantize_gathers={config.quantize_gathers!r}` is not a gather encoding; use None (the "
            'compute dtype) or "int8" (int8 blocks with a scale each).'
        )


class OffloadTier(str, Enum):
    """Where offloaded state lives (``offload_optimizer`` / ``offload_params``; ``None`` is the training
    device). A ``str``, so ``config.offload_optimizer == "nvme"``, YAML and JSON see the plain names."""

    CPU = "cpu"  # host memory
    NVME = "nvme"  # swap files under ``nvme_path``

    @property
    def depth(self) -> int:
        """How far from the device: a parameter tier may not be deeper than the optimizer's."""
        return 1 if self is OffloadTier.CPU else 2

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:  # messages name the setting's value as the user wrote it
        return repr(self.value)


CHECKPOINT_FORMATS = ("sharded", "full")


def default_nvme_path() -> str:
    """Where ``"zero3_offload_nvme"`` swaps when no ``nvme_path`` is given: the system temp directory
    (``$TMPDIR``, else ``/tmp``); the swap files go into a private ``lightning_zero3-<user>`` folder there."""
    import tempfile

    return tempfile.gettempdir()


def _check_offload(config: "Zero3Config") -> None:
    for name in ("offload_optimizer", "offload_params"):
        value = getattr(config, name)
        if value in ("none", "device"):
            object.__setattr__(config, name, None)
        elif value in tuple(OffloadTier):
            object.__setattr__(config, name, OffloadTier(value))
        elif value is not None and value != "auto":
            raise Zero3ConfigError(
                f"zero3: `{name}={value!r}` is not an offload target; use None (stay on the training device), "
                '"cpu" or "nvme", or "auto" (the lightest plan that fits `memory_budget`).'
            )
    try:
        budget = parse_budget(config.memory_budget) if config.memory_budget is not None else "auto"
    except ValueError:
        budget = -1
    if budget != "auto" and (not isinstance(budget, int) or budget <= 0):
        raise Zero3ConfigError(
            f"zero3: `memory_budget={config.memory_budget!r}` is not a budget; give bytes per rank (an int > 0, or a "
            'string such as "24GB" / "512MiB") or "auto" (free memory at setup less a margin).'
        )
    auto = "auto" in (config.offload_optimizer, config.offload_params)
    if config.memory_budget is not None and not auto:
        raise Zero3ConfigError(
            f"zero3: `memory_budget={config.memory_budget!r}` is read only by the automatic plan; set "
            'offload_optimizer="auto" (and offload_params="auto" to let parameters move too), or drop memory_budget.'
        )
    if auto and config.offload_optimizer != "auto" and config.offload_params == "auto" and config.offload_optimizer is None:
        raise Zero3ConfigError(
            'zero3: `offload_params="auto"` needs `offload_optimizer` "auto" (or "cpu" / "nvme"): parameters can '
            "only leave the device with the optimizer; got offload_optimizer=None."
        )
    if auto and not config.nvme_path:
        raise Zero3ConfigError(
            'zero3: an "auto" offload plan may choose NVMe and needs `nvme_path`, a directory on a fast local disk '
            'for the swap files; for example nvme_path="/local_nvme".'
        )
    def depth(tier: Optional[OffloadTier]) -> int:
        return 0 if tier is None else tier.depth

    if not auto and depth(config.offload_params) > depth(config.offload_optimizer):
        raise Zero3ConfigError(
            f"zero3: `offload_params={config.offload_params!r}` needs `offload_optimizer` at the same tier or "
            f"deeper (the optimizer steps the shards where it keeps them), got `offload_optimizer="
            f"{config.offload_optimizer!r}`; set offload_optimizer={config.offload_params!r}."
        )
    uses_nvme = OffloadTier.NVME in (config.offload_optimizer, config.offload_params) and not auto
    if uses_nvme and not config.nvme_path:
        raise Zero3ConfigError(
            "zero3: offload to \"nvme\" needs `nvme_path`, a directory on a fast local disk for the swap "
            "files; for example nvme_path=\"/local_nvme\"."
        )
    if config.nvme_path is not None and not isinstance(config.nvme_path, (str, os.PathLike)):
        raise Zero3ConfigError(f"zero3: `nvme_path` must be a directory path, got {config.nvme_path!r}.")
    if not isinstance(config.offload_pin_memory, bool):
        raise Zero3ConfigError(
            f"zero3: `offload_pin_memory` must be True or False, got {config.offload_pin_memory!r}."
        )
    _check_int("offload_buffer_count", config.offload_buffer_count, minimum=2)
    _check_int("offload_buffer_size", config.offload_buffer_size, minimum=1)
    object.__setattr__(config, "offload_buffer_count", int(config.offload_buffer_count))
    object.__setattr__(config, "offload_buffer_size", int(config.offload_buffer_size))
