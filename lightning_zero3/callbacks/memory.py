"""``MemoryMonitor``: the bytes zero3 holds, by category, and how fragmented the allocator is.

Tags (each with ``/mean`` and ``/max`` over the ranks), under ``zero3/memory/``:
  - ``<category>_bytes`` for every category of the engine's byte ledger (``param_shards``,
    ``grad_shards``, ``persistent_params``, ``gathered_params``, and any category an engine part adds,
    such as offload buffers), ``optimizer_state_bytes`` and ``peak_gathered_params_bytes``: exactly
    ``engine.memory_report()`` at that step;
  - the allocator's figures (``allocator.py``): ``fragmentation`` (0..1) and, on CUDA, ``cached_slack``,
    ``alloc_retries``, ``reserved_bytes``, ``allocated_bytes``; on the host ``heap_arena_bytes``,
    ``heap_free_bytes``, ``mmapped_bytes``, ``rss_bytes``, ``engine_share_of_rss``.

Advice when the worst rank's fragmentation exceeds ``fragmentation_threshold`` (default 0.15).
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
            fragmentation on some rank exceeds this fraction.
    """

    section = "memory"

    def __init__(self, every_n_steps: Optional[int] = None, fragmentation_threshold: float = 0.15) -> None:
        super().__init__(every_n_steps)
        if not 0 < fragmentation_threshold <= 1:
            raise Zero3MonitorError(
                f"MemoryMonitor: `fragmentation_threshold` must be in (0, 1], got {fragmentation_threshold!r}."
            )
        self.fragmentation_threshold = fragmentation_threshold
        self._retries_at_start: Optional[int] = None

    def start(self, trainer: "pl.Trainer") -> None:
        device = self.engine.device
        self._retries_at_start = cuda_retries(device) if device.type == "cuda" else None

    def figures(self, trainer: "pl.Trainer") -> Figures:
        report = self.engine.memory_report()
        figures = {f"{name}_bytes": float(value) for name, value in report.items()}
        held = sum(v for k, v in report.items() if not k.startswith("peak_"))
        figures.update(allocator_figures(self.engine.device, held, self._retries_at_start))
        return figures

    def advise(self, mean: Figures, maximum: Figures, trainer: "pl.Trainer") -> list[tuple[str, str]]:
        worst = maximum.get("fragmentation", 0.0)
        if not worst > self.fragmentation_threshold:
            return []
        where = "cuda" if self.engine.device.type == "cuda" else "cpu"
        allocator = "CUDA caching allocator" if where == "cuda" else "host heap (glibc malloc)"
        return [(
            "fragmentation",
            f"{worst:.0%} of the {allocator} is free but unusable on the worst rank (threshold "
            f"{self.fragmentation_threshold:.0%}): memory is reserved that no tensor can use. To change: {_HOW[where]}.",
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
        if self.engine.device.type == "cuda":
            charts["allocator retries"] = ["Multiline", [r"zero3/memory/alloc_retries/.*"]]
        return {"zero3 memory": charts}
