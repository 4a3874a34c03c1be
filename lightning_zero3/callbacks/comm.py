"""``CommMonitor``: what zero3's collectives moved, how fast, and how much of it compute waited for.

Per collective kind (``all_gather``, ``reduce_scatter``, ``all_reduce``, ``broadcast``), over the steps
since the last log, under ``zero3/comm/<kind>/`` (each with ``/mean`` and ``/max`` over the ranks):
  - ``bytes``, ``count``, ``seconds`` (issue to completion: the host's clock on gloo, device events on
    CUDA, see [Note: completion time] in ``engine/comm/timing.py``), ``exposed_seconds`` (time the compute
    side waited for it);
  - ``inter_node_bytes``: the bytes this rank received from ranks on other nodes (a rank's node is its
    global rank // the Trainer's ``devices``; see [Note: inter-node bytes] in ``engine/comm/topology.py``);
  - ``algbw_GBps`` = bytes / seconds, with bytes the full (gathered or pre-scatter) buffer, and
    ``busbw_GBps`` = algbw x (n-1)/n for all-gather and reduce-scatter, x 2(n-1)/n for all-reduce
    (nccl-tests' ``PERFORMANCE.md``; n = the engine's group size);
  - ``utilization``: busbw against the peak busbw measured for the same kind and message size on this
    job's group at start-up, right after the first step, when the sizes this job uses are known
    (``Communicator.measure_peaks``, like nccl-tests: warm-up calls, then ``peak_repeats`` timed calls,
    the slowest rank's median, see [Note: peak bandwidth] in ``engine/comm/communicator.py``; a size first seen later
    is measured then), weighted by message: sum(bytes_s / peak_algbw_s) / sum(seconds_s) over the sizes
    s. It is logged as it is: above 1, training beat the measured peak, which means the peak measurement
    is off (taken while the machine was busy, or from too few calls), and the monitor warns once per
    kind, with how to measure again.
And ``zero3/comm/prefetch_hit_rate``: the share of unit starts whose parameters were already gathered
or in flight; ``zero3/comm/trace_changes``: the training steps (backward passes) of the interval whose
unit order differed from the recorded trace (see [Note: the trace may change] in ``engine/schedule/prefetch.py``).

Advice speaks only where acting on it would matter (see docs/monitoring.md), each kind of advice at most
once per run: when an all-gather or reduce-scatter runs below ``utilization_threshold`` (default 0.7) of
peak *and* the compute waited for it (its exposed time, averaged over ranks) at least
``exposed_threshold`` (default 5%) of the interval's wall time *and* the settings it names can still
change something for this model (some unit is not bucketed yet, or the prefetch window does not hold
every unit); when a kind's utilization, averaged over
ranks, exceeds 1 (the mean over ranks, not one rank's figure: the rank that arrives last at a collective
waits least for it, and can beat a true peak) under the same exposed-time condition; and when the trace
changed in most steps of an interval (prefetch then gathers units that do not run).
"""

from __future__ import annotations

import math
import time
from typing import Optional

import lightning.pytorch as pl

from ..engine.comm.communicator import Communicator
from .monitor import Figures, Layout, Zero3Monitor, Zero3MonitorError

NAN = float("nan")

_HOW = {
    "all_gather": (
        "raise `prefetch_bucket_size` (gathers are issued earlier and overlap more compute) or "
        "`reduce_bucket_size` (units below it share one all-gather: fewer, larger messages)"
    ),
    "reduce_scatter": (
        "raise `reduce_bucket_size` (gradients of units below it are reduce-scattered together: fewer, "
        "larger messages), and keep `overlap_comm=True`"
    ),
}


class CommMonitor(Zero3Monitor):
    """Log zero3's communication figures to the Trainer's loggers every ``every_n_steps`` steps.

    Args:
        every_n_steps: Optimizer steps between logs; ``None``: the Trainer's ``log_every_n_steps``.
        utilization_threshold: Warn (once per collective kind) and write advice to TensorBoard when an
            all-gather or reduce-scatter reaches less than this fraction of its measured peak busbw.
        peak_repeats: Timed calls per message size when measuring the peak bandwidth (after two
            untimed ones); raise it when the monitor warns that the peak measurement is off.
        exposed_threshold: Bandwidth advice is given only when the compute waited for that collective
            kind at least this fraction of the interval's wall time (averaged over ranks): below it,
            faster collectives would not make the step faster.
    """

    section = "comm"

    def __init__(
        self,
        every_n_steps: Optional[int] = None,
        utilization_threshold: float = 0.7,
        peak_repeats: int = 5,
        exposed_threshold: float = 0.05,
    ) -> None:
        super().__init__(every_n_steps)
        if not 0 < utilization_threshold <= 1:
            raise Zero3MonitorError(
                f"CommMonitor: `utilization_threshold` must be in (0, 1], got {utilization_threshold!r}."
            )
        if not 0 <= exposed_threshold <= 1:
            raise Zero3MonitorError(
                f"CommMonitor: `exposed_threshold` must be in [0, 1], got {exposed_threshold!r}."
            )
        if peak_repeats < 1:
            raise Zero3MonitorError(f"CommMonitor: `peak_repeats` must be >= 1, got {peak_repeats!r}.")
        self.utilization_threshold = utilization_threshold
        self.peak_repeats = peak_repeats
        self.exposed_threshold = exposed_threshold
        self._seen: dict = {}
        self._interval_steps = 0  # backward passes in the interval that ``figures`` last covered

    def start(self, trainer: "pl.Trainer") -> None:
        self._seen = self._snapshot()

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *args) -> None:
        if trainer.global_step >= 1 and not self.engine.comm.peak_busbw:
            self.engine.comm.measure_peaks(self.peak_repeats)  # start-up: every rank, after the first step
        super().on_train_batch_end(trainer, pl_module, *args)

    def _snapshot(self) -> dict:
        comm, schedule = self.engine.comm, self.engine.schedule
        totals = {k: (s.count, s.bytes, s.seconds, s.exposed_seconds, s.inter_node_bytes) for k, s in comm.stats.items()}
        sizes = {key: (s.bytes, s.seconds) for key, s in comm.by_size.items()}
        return {
            "kinds": totals,
            "sizes": sizes,
            "prefetch": (schedule.prefetch_hits, schedule.starts),
            "trace": (schedule.trace_changes, schedule.steps),
            "clock": time.perf_counter(),
        }

    def figures(self, trainer: "pl.Trainer") -> Figures:
        comm = self.engine.comm
        # Sizes first used after start-up (say, gathers coalesced once prefetch runs) are measured now.
        # A collective: every rank has run the same collectives, so every rank measures the same sizes.
        peaks = comm.measure_peaks(self.peak_repeats)
        now, before = self._snapshot(), self._seen
        self._seen = self._snapshot()  # measuring does not count, see Communicator.measure_peaks
        figures: Figures = {}
        for kind, (count, nbytes, seconds, exposed, inter_node) in now["kinds"].items():
            c0, b0, s0, e0, i0 = before["kinds"].get(kind, (0, 0, 0.0, 0.0, 0))
            count, nbytes, seconds, exposed = count - c0, nbytes - b0, seconds - s0, exposed - e0
            algbw = nbytes / seconds / 1e9 if count and seconds > 0 else NAN
            figures[f"{kind}/bytes"] = float(nbytes)
            figures[f"{kind}/inter_node_bytes"] = float(inter_node - i0)
            figures[f"{kind}/count"] = float(count)
            figures[f"{kind}/seconds"] = seconds
            figures[f"{kind}/exposed_seconds"] = exposed
            figures[f"{kind}/algbw_GBps"] = algbw
            figures[f"{kind}/busbw_GBps"] = algbw * comm.bus_factor(kind)
            figures[f"{kind}/utilization"] = self._utilization(kind, now["sizes"], before["sizes"], peaks)
        hits, starts = (a - b for a, b in zip(now["prefetch"], before["prefetch"]))
        figures["prefetch_hit_rate"] = hits / starts if starts else NAN
        changes, self._interval_steps = (a - b for a, b in zip(now["trace"], before.get("trace", (0, 0))))
        figures["trace_changes"] = float(changes)
        figures["interval_seconds"] = now["clock"] - before.get("clock", now["clock"])
        return figures

    def _utilization(self, kind: str, now: dict, before: dict, peaks: dict) -> float:
        ideal = actual = 0.0
        for key, (nbytes, seconds) in now.items():
            if key[0] != kind or key not in peaks:
                continue
            b0, s0 = before.get(key, (0, 0.0))
            if nbytes - b0 <= 0 or seconds - s0 <= 0:
                continue
            factor = self.engine.comm.bus_factor(kind)
            ideal += (nbytes - b0) / (peaks[key] / factor)
            actual += seconds - s0
        return ideal / actual if actual > 0 else NAN

    def advise(self, mean: Figures, maximum: Figures, trainer: "pl.Trainer") -> list[tuple[str, str]]:
        advice = []
        changes, steps = maximum.get("trace_changes", 0.0), self._interval_steps
        if steps and changes > steps / 2:
            advice.append((
                "trace_changes",
                f"the order in which zero3's units run changed in {changes:.0f} of the last {steps} steps. Prefetch "
                "follows the order recorded at the previous step, so it gathered units that did not run next "
                "(they are released unused: wasted bandwidth). To change: make the order the same every step (run "
                "every layer and mask its output instead of skipping it; call the model the same number of times "
                "each step; keep modules chosen by the data inside one unit with `unit_modules`), or set "
                "`prefetch_bucket_size=0` to gather each unit only when it starts.",
            ))
        for kind, how in _HOW.items():
            utilization = mean.get(f"{kind}/utilization", NAN)
            if not (self._exposed_enough(kind, mean) and self._knobs_can_help(kind)):
                continue
            if math.isfinite(utilization) and utilization < self.utilization_threshold:
                advice.append((
                    f"{kind}_utilization",
                    f"{kind} ran at {utilization:.0%} of the peak bus bandwidth measured on this job's group for "
                    f"its message sizes (threshold {self.utilization_threshold:.0%}), averaged over ranks, and the "
                    f"compute waited for it {self._exposed_share(kind, mean):.0%} of the time: its messages are "
                    f"waiting behind compute or each other, or are too small. To change: {how}.",
                ))
        for kind in Communicator.KINDS:
            utilization = mean.get(f"{kind}/utilization", NAN)
            if math.isfinite(utilization) and utilization > 1 and self._exposed_enough(kind, mean):
                advice.append((
                    f"{kind}_peak",
                    f"{kind} reached {utilization:.0%} of the peak bus bandwidth measured at start-up for its message "
                    f"sizes, averaged over ranks: training cannot beat a true peak, so the peak measurement is off "
                    f"(measured while something else used the devices or links, or from too few calls). The "
                    f"utilization is logged as it is. To measure again: raise `CommMonitor(peak_repeats=...)` "
                    f"(now {self.peak_repeats}) and start the job when nothing else runs on its machines.",
                ))
        return advice

    def _exposed_share(self, kind: str, mean: Figures) -> float:
        wall = mean.get("interval_seconds", 0.0)
        return mean.get(f"{kind}/exposed_seconds", 0.0) / wall if wall > 0 else 0.0

    def _exposed_enough(self, kind: str, mean: Figures) -> bool:
        """Whether the compute waited for ``kind`` long enough that a faster ``kind`` would shorten the step."""
        return self._exposed_share(kind, mean) >= self.exposed_threshold

    def _knobs_can_help(self, kind: str) -> bool:
        """Whether the settings the advice names would change anything for this model: a larger
        ``reduce_bucket_size`` matters only where some unit is not bucketed already, a larger
        ``prefetch_bucket_size`` only where the window does not hold every unit already."""
        try:
            config, sizes = self.engine.config, [rt.group.numel for rt in self.engine.runtimes]
        except AttributeError:  # an engine without that accounting: do not hold the advice back
            return True
        unbucketed = any(n >= config.reduce_bucket_size for n in sizes)
        if kind == "reduce_scatter":
            return unbucketed or not config.overlap_comm
        return unbucketed or config.prefetch_bucket_size < sum(sizes)

    def layout(self) -> Layout:
        kinds = "(all_gather|reduce_scatter|all_reduce|broadcast)"
        return {
            "zero3 communication": {
                "bus bandwidth GB/s (mean over ranks)": ["Multiline", [rf"zero3/comm/{kinds}/busbw_GBps/mean"]],
                "utilization of measured peak": ["Multiline", [rf"zero3/comm/{kinds}/utilization/mean"]],
                "exposed seconds (max over ranks)": ["Multiline", [rf"zero3/comm/{kinds}/exposed_seconds/max"]],
                "bytes (mean over ranks)": ["Multiline", [rf"zero3/comm/{kinds}/bytes/mean"]],
                "bytes from other nodes (mean over ranks)": ["Multiline", [rf"zero3/comm/{kinds}/inter_node_bytes/mean"]],
                "prefetch hit rate": ["Multiline", [r"zero3/comm/prefetch_hit_rate/mean"]],
                "steps whose unit order changed": ["Multiline", [r"zero3/comm/trace_changes/max"]],
            }
        }
