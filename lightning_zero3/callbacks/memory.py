"""``MemoryMonitor``: the bytes zero3 holds, by category, and how fragmented the allocator is.

Tags (each with ``/mean`` and ``/max`` over the ranks), under ``zero3/memory/``:
  - ``<category>_bytes`` for every category of the engine's byte ledger (``param_shards``,
    ``grad_shards``, ``persistent_params``, ``gathered_params``, and any category an engine part adds,
    such as offload buffers), ``optimizer_state_bytes`` and ``peak_gathered_params_bytes``: exactly
    ``engine.memory_report()`` at that step;
  - the allocator's figures (``allocator.py``): ``fragmentation`` (0..1) and, on CUDA, ``cached_slack``,
    ``alloc_retries``, ``reserved_bytes``, ``allocated_bytes``; on the host ``heap_arena_bytes``,
    ``heap_free_bytes``, ``mmapped_bytes``, ``rss_bytes``, ``engine_share_of_rss``;
  - ``plan_level`` under an automatic offload plan (``memory_budget``): the level it holds the budget
    with, 0 as chosen at setup, higher leaner (see docs/will-it-fit.md).

Advice (once per run) when the worst rank's fragmentation exceeds ``fragmentation_threshold`` (default
0.15) *and* the wasted bytes matter: at least ``min_wasted_bytes`` (default 64 MiB) and at least
``min_wasted_share`` (default 20%) of the rank's memory (RSS on the host, reserved bytes on CUDA). The
wasted bytes are the heap's free bytes that are resident on the host (free pages
returned to the kernel waste nothing) and the inactive split bytes on CUDA. A small model's
heap can be 80% free and still waste only a few MB: nothing to act on (see docs/monitoring.md).
"""

from __future__ import annotations

from typing import Optional

import lightning.pytorch as pl

from .allocator import allocator_figures, cuda_retries
from .monitor import Figures, Layout, Zero3Monitor, Zero3MonitorError

_HOW = {
    "cuda": (
        "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (segments grow in place instead of splitting), "
        "or make units alike in size (`unit_modules`) and lower `max_live_parameters`, so the gathered "
        "buffers freed and re-allocated every step fit the same blocks"
    ),
    "cpu": (
        "lower `max_live_parameters` / `prefetch_bucket_size` (fewer gathered buffers of different sizes alive "
        "at once), or set MALLOC_MMAP_THRESHOLD_ (bytes; zero3 sets 4 MiB unless you do) below the size of your "
        "own code's large host tensors (activations, batches) so glibc maps them and returns them to the OS "
        "when they are freed"
    ),
}


class MemoryMonitor(Zero3Monitor):
    """Log zero3's memory figures to the Trainer's loggers every ``every_n_steps`` steps.

    Args:
        every_n_steps: Optimizer steps between logs; ``None``: the Trainer's ``log_every_n_steps``.
        fragmentation_threshold: Warn (once) and write advice to TensorBoard when the allocator's
            fragmentation on some rank exceeds this fraction ...
        min_wasted_bytes: ... and the bytes it wastes are at least this many ...
        min_wasted_share: ... and at least this fraction of the rank's memory (RSS on the host, the
            allocator's reserved bytes on CUDA).
    """

    section = "memory"

    def __init__(
        self,
        every_n_steps: Optional[int] = None,
        fragmentation_threshold: float = 0.15,
        min_wasted_bytes: int = 64 * 2**20,
        min_wasted_share: float = 0.20,
    ) -> None:
        super().__init__(every_n_steps)
        if not 0 < fragmentation_threshold <= 1:
            raise Zero3MonitorError(
                f"MemoryMonitor: `fragmentation_threshold` must be in (0, 1], got {fragmentation_threshold!r}."
            )
        if min_wasted_bytes < 0 or not 0 <= min_wasted_share <= 1:
            raise Zero3MonitorError(
                f"MemoryMonitor: `min_wasted_bytes` must be >= 0 and `min_wasted_share` in [0, 1], got "
                f"{min_wasted_bytes!r} and {min_wasted_share!r}."
            )
        self.fragmentation_threshold = fragmentation_threshold
        self.min_wasted_bytes = min_wasted_bytes
        self.min_wasted_share = min_wasted_share
        self._retries_at_start: Optional[int] = None

    def start(self, trainer: "pl.Trainer") -> None:
        device = self.engine.device
        self._retries_at_start = cuda_retries(device) if device.type == "cuda" else None

    def figures(self, trainer: "pl.Trainer") -> Figures:
        report = self.engine.memory_report()
        figures = {f"{name}_bytes": float(value) for name, value in report.items()}
        held = sum(v for k, v in report.items() if not k.startswith("peak_"))
        figures.update(allocator_figures(self.engine.device, held, self._retries_at_start))
        if self.engine.dynamic_plan is not None:  # the automatic plan's level in force (engine/plan/dynamic.py)
            figures["plan_level"] = float(self.engine.dynamic_plan.level)
        return figures

    def advise(self, mean: Figures, maximum: Figures, trainer: "pl.Trainer") -> list[tuple[str, str]]:
        worst = maximum.get("fragmentation", 0.0)
        if not worst > self.fragmentation_threshold:
            return []
        where = "cuda" if self.engine.device.type == "cuda" else "cpu"
        if where == "cuda":
            held = maximum.get("reserved_bytes", 0.0)
            wasted = worst * held  # inactive split bytes of the worst rank, about
        else:
            held = maximum.get("rss_bytes", 0.0)
            # free heap bytes that are resident (pages zero3 returned to the kernel waste nothing)
            wasted = maximum.get("heap_free_resident_bytes", maximum.get("heap_free_bytes", 0.0))
        if wasted < self.min_wasted_bytes or (held > 0 and wasted < self.min_wasted_share * held):
            return []  # a fragmented heap that wastes little: nothing worth acting on
        allocator = "CUDA caching allocator" if where == "cuda" else "host heap (glibc malloc)"
        return [(
            "fragmentation",
            f"{worst:.0%} of the {allocator} is free but unusable on the worst rank (threshold "
            f"{self.fragmentation_threshold:.0%}), {wasted / 2**20:.0f} MiB: memory is reserved that no tensor "
            f"can use. To change: {_HOW[where]}.",
        )]

    def layout(self) -> Layout:
        # the engine's own categories (whatever its parts add), apart from the allocator's byte figures
        held = "|".join(self.engine.memory_report())
        charts = {
            "engine bytes by category (max over ranks)": ["Multiline", [rf"zero3/memory/({held})_bytes/max"]],
            "fragmentation": ["Multiline", [r"zero3/memory/(fragmentation|cached_slack|engine_share_of_rss)/.*"]],
            "allocator bytes (max over ranks)": [
                "Multiline", [r"zero3/memory/(rss|heap_arena|heap_free|mmapped|reserved|allocated)_bytes/max"]
            ],
        }
        if self.engine.dynamic_plan is not None:
            charts["automatic plan level"] = ["Multiline", [r"zero3/memory/plan_level/.*"]]
        if self.engine.device.type == "cuda":
            charts["allocator retries"] = ["Multiline", [r"zero3/memory/alloc_retries/.*"]]
        return {"zero3 memory": charts}
