"""Collective timing on every backend, utilization against the measured peak, and the monitors' gather device.

The CUDA path (device events, [Note: completion time] in ``engine/comm/timing.py``) runs here against a fake
``torch.cuda`` whose streams carry clocks the test moves: the same ``EventClock`` / ``EventSpan`` /
``Communicator`` code, with the test deciding when the device reaches each event.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks

from lightning_zero3.callbacks import CommMonitor, MemoryMonitor
from lightning_zero3.engine.comm.communicator import Communicator
from lightning_zero3.engine.comm.timing import EventClock, HostClock, clock_for

# -- a fake device module: torch.cuda's names, streams with clocks (milliseconds) -----------------------


class FakeStream:
    def __init__(self) -> None:
        self.time = 0.0  # how far this stream's work reaches, in device milliseconds


class FakeEvent:
    def __init__(self, device: "FakeDevice", enable_timing: bool = False) -> None:
        assert enable_timing
        self.device, self.time = device, None

    def record(self, stream=None) -> None:
        self.time = (stream or self.device.current).time

    def query(self) -> bool:
        return self.time <= self.device.reached

    def synchronize(self) -> None:
        self.device.syncs += 1
        self.device.reached = max(self.device.reached, self.time)

    def elapsed_time(self, other: "FakeEvent") -> float:
        return other.time - self.time


class FakeDevice:
    """Work is enqueued by moving a stream's clock; ``reached`` is how far the device has executed."""

    def __init__(self) -> None:
        self.compute = self.current = FakeStream()
        self.timing_streams: list[FakeStream] = []
        self.reached = 0.0
        self.syncs = 0  # host waits on the device

    def Event(self, enable_timing: bool = False) -> FakeEvent:  # noqa: N802 (torch.cuda's name)
        return FakeEvent(self, enable_timing)

    def Stream(self, device=None) -> FakeStream:  # noqa: N802
        self.timing_streams.append(FakeStream())
        return self.timing_streams[-1]

    def current_stream(self, device=None) -> FakeStream:
        return self.current

    @contextmanager
    def stream(self, stream: FakeStream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def synchronize(self, device=None) -> None:
        self.syncs += 1


class FakeWork:
    """A collective that ends at device time ``ends``; waiting on it makes the current stream wait."""

    def __init__(self, device: FakeDevice, ends: float) -> None:
        self.device, self.ends = device, ends

    def _stream_wait(self) -> None:
        self.device.current.time = max(self.device.current.time, self.ends)

    def wait(self) -> None:
        assert self.device.current is self.device.compute  # the caller's wait: on the compute stream
        self._stream_wait()

    def get_future(self):
        def wait():
            assert self.device.current is not self.device.compute  # the timing stream waits, not compute
            self._stream_wait()

        return SimpleNamespace(wait=wait)


def _event_comm(monkeypatch, device: FakeDevice) -> tuple[Communicator, list]:
    """A two-rank communicator on the fake device; ``ends`` lists when each issued all-gather will end."""
    comm = Communicator()
    comm.world_size, comm.rank = 2, 0
    comm._clock = EventClock(torch.device("cpu"), device_module=device)
    ends: list[float] = []
    monkeypatch.setattr(dist, "all_gather_single", lambda *a, **k: FakeWork(device, ends.pop(0)))
    return comm, ends


def test_event_timings_are_read_when_figures_are_asked_for_not_on_the_hot_path(monkeypatch):
    device = FakeDevice()
    comm, ends = _event_comm(monkeypatch, device)
    full, shard = torch.zeros(8), torch.zeros(4)
    # issued at compute time 0, ends at 5; compute runs until 8, then waits: nothing left to wait for
    ends.append(5.0)
    pending = comm.all_gather(full, shard, async_op=True)
    device.compute.time = 8.0
    pending.wait()
    assert device.syncs == 0 and comm.pending_timings == 1  # waited, not read: no host sync
    stats = comm.stats["all_gather"]  # asking for figures reads the events (the one sync)
    assert device.syncs > 0 and comm.pending_timings == 0
    assert (stats.count, stats.bytes) == (1, 32)
    assert stats.seconds == pytest.approx(0.005)  # to the collective's end, not to the wait at 8
    assert stats.exposed_seconds == pytest.approx(0.0)  # the compute stream never stalled
    # issued at 10, ends at 14, waited for at once: the compute stream stalls for all 4 ms
    ends.append(14.0)
    device.compute.time = 10.0
    comm.all_gather(full, shard)
    stats = comm.stats["all_gather"]
    assert stats.count == 2
    assert stats.seconds == pytest.approx(0.009) and stats.exposed_seconds == pytest.approx(0.004)
    assert len(device.timing_streams) == 1  # one timing stream, reused


def test_the_hot_path_drains_only_timings_the_device_has_finished(monkeypatch):
    device = FakeDevice()
    comm, ends = _event_comm(monkeypatch, device)
    full, shard = torch.zeros(8), torch.zeros(4)
    for _ in range(comm.DRAIN_AT):
        ends.append(device.compute.time + 1.0)
        comm.all_gather(full, shard)
    assert comm.pending_timings == comm.DRAIN_AT  # held until there are too many
    device.reached = device.compute.time  # the device has run everything so far
    ends.append(device.compute.time + 1.0)
    comm.all_gather(full, shard)
    # the finished ones were drained, without a host sync; the last is not finished, so it stays
    assert comm.pending_timings == 1 and device.syncs == 0
    assert comm._stats["all_gather"].count == comm.DRAIN_AT
    assert comm.stats["all_gather"].count == comm.DRAIN_AT + 1


class LogicalClock:
    """A stand-in for ``time`` in ``engine/timing.py``: ``perf_counter()`` reads a counter that moves only
    when told (``advance``) and by ``step`` at every reading, so the order of the marks a span takes is
    visible in their values, whatever the host's scheduler does."""

    def __init__(self, step: float = 1.0) -> None:
        self.now, self.step = 0.0, step

    def perf_counter(self) -> float:
        self.now += self.step
        return self.now

    def advance(self, ticks: float) -> None:
        self.now += ticks


def test_one_rank_copies_and_host_collectives_use_the_host_clock(monkeypatch):
    from lightning_zero3.engine.comm import timing

    assert isinstance(clock_for(torch.device("cpu")), HostClock)
    assert isinstance(clock_for(torch.device("cuda", 0)), EventClock)
    clock = LogicalClock()
    monkeypatch.setattr(timing, "time", clock)
    comm = Communicator()  # one rank, no process group: copies on the host
    full, shard = torch.zeros(1000), torch.ones(1000)
    pending = comm.all_gather(full, shard, async_op=True)
    clock.advance(1000)  # compute while the "collective" is already complete
    pending.wait()
    stats = comm.stats["all_gather"]
    assert stats.count == 1 and torch.equal(full, shard)
    # The marks in the order they were taken: issued (tick 1), completed inside the call (tick 2), then
    # the wait begins (1003) and ends (1004). Issue to completion is the one tick between the first two:
    # completion was stamped inside the call, before the compute in between and before the wait.
    assert stats.seconds == 1.0
    assert stats.exposed_seconds == 0.0  # completed before the wait began: nothing exposed


# -- the monitors gather on the device of the engine's group ------------------------------------------


class MetaGroupComm(Communicator):
    """A communicator whose group would run on the meta device."""

    @property
    def device(self) -> torch.device:
        return torch.device("meta")


@pytest.mark.parametrize("monitor", [MemoryMonitor(), CommMonitor()], ids=["memory", "comm"])
def test_monitors_gather_on_the_device_of_the_engines_group(monitor):
    engine = SimpleNamespace(
        comm=MetaGroupComm(), device=torch.device("cpu"),
        schedule=SimpleNamespace(prefetch_hits=0, starts=0, trace_changes=0, steps=0),
    )
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(engine=engine), log_every_n_steps=1, global_step=0, is_global_zero=False, loggers=[]
    )
    monitor.on_train_start(trainer, SimpleNamespace(device=torch.device("cpu")))  # the module is on the host
    assert monitor._aggregate.device == torch.device("meta")
    assert monitor._row({"a": 1.0, "b": 2.0}).device == torch.device("meta")


# -- utilization: slower collectives lower it, faster raise it; a beaten peak is logged and warned ------

ELEMENTS = 1 << 18  # a 1 MiB all-gather
# Collective times on a logical clock (see ``LogicalClock``, in seconds, still between readings): each
# all-gather takes PLAIN, or SLOWED while slowed, whatever the host does. Powers of two, as are the bytes
# and the bus factor: every time, bandwidth and utilization below is exact in floating point.
PLAIN, SLOWED = 2.0**-10, 2.0**-5


@contextmanager
def _collectives_take(clock: LogicalClock, ticks: float):
    """Every all-gather issued inside takes ``ticks`` on ``clock``: the clock moves before the real call,
    so the issue mark precedes the move and the completion mark (stamped when gloo finishes) follows it."""
    real = dist.all_gather_single

    def timed(*args, **kwargs):
        clock.advance(ticks)
        return real(*args, **kwargs)

    dist.all_gather_single = timed
    try:
        yield
    finally:
        dist.all_gather_single = real


def _utilization_case(rank: int, world: int) -> dict:
    from lightning_zero3.engine.comm import timing

    clock = timing.time = LogicalClock(step=0.0)  # this rank's process only: it ends with the case
    comm = Communicator()
    engine = SimpleNamespace(comm=comm, schedule=SimpleNamespace(prefetch_hits=0, starts=0, trace_changes=0, steps=0))
    trainer = SimpleNamespace(strategy=SimpleNamespace(engine=engine), log_every_n_steps=1, global_step=0,
                              is_global_zero=rank == 0, loggers=[])  # fmt: skip
    # every interval's advice is judged, however little of it the compute waited (the exposed-share gate
    # has its own tests in test_monitors.py): here only the peak is under test
    monitor = CommMonitor(every_n_steps=1, exposed_threshold=0.0)
    full, shard = torch.zeros(ELEMENTS), torch.ones(ELEMENTS // world)
    with _collectives_take(clock, PLAIN):
        comm.all_gather(full, shard)  # first-call set-up, before the monitor starts counting
    monitor.on_train_start(trainer, None)
    utilization, warned = {}, {}

    def interval(name: str) -> None:
        """Four all-gathers, then a log step: the mean utilization over ranks logged, the warnings given."""
        for _ in range(4):
            comm.all_gather(full, shard)
        trainer.global_step += 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            monitor.on_train_batch_end(trainer, None)
        utilization[name] = monitor.last_logged.get("zero3/comm/all_gather/utilization/mean", float("nan"))
        warned[name] = [str(w.message) for w in caught if "all_gather reached" in str(w.message)]

    with _collectives_take(clock, PLAIN):
        interval("plain")  # the start-up peak is measured at this first log
    peaks = dict(comm.peak_busbw)
    with _collectives_take(clock, SLOWED):
        interval("slowed")
    with _collectives_take(clock, PLAIN):
        interval("plain_again")
    unchanged = comm.peak_busbw == peaks  # training does not move the peak
    comm.peak_busbw.clear()
    with _collectives_take(clock, SLOWED):
        comm.measure_peaks(monitor.peak_repeats)  # a peak measured while something slowed the group
    with _collectives_take(clock, PLAIN):
        interval("beaten")
    return {"utilization": utilization, "warned": warned, "peaks_unchanged": unchanged}


def test_utilization_falls_with_slower_collectives_and_is_logged_above_one_when_the_peak_is_off():
    result = run_ranks(_utilization_case, 2)[0]  # rank 0 logs
    utilization, warned = result["utilization"], result["warned"]
    # Each all-gather takes PLAIN on the logical clock (SLOWED while slowed), and the peak is measured on
    # plain calls: a plain interval runs at its peak, a slowed one at PLAIN / SLOWED of it, and plain calls
    # against a peak measured on slowed ones at SLOWED / PLAIN.
    assert utilization == {"plain": 1.0, "slowed": PLAIN / SLOWED, "plain_again": 1.0, "beaten": SLOWED / PLAIN}
    assert result["peaks_unchanged"]  # and "beaten" is logged as it is: no clamp
    # warned once, at the first log above 1: the beaten peak's
    assert [name for name, messages in warned.items() if messages] == ["beaten"]
    message = warned["beaten"]
    assert len(message) == 1 and "the peak measurement is off" in message[0] and "peak_repeats" in message[0]


def _pair_case(rank: int, world: int) -> dict:
    comm = Communicator()
    comm.open_side_groups()  # the reduce-scatters on their own group, as in training
    numel = 2 * 1000 + 2 * 24  # even, as a padded flat group is
    torch.manual_seed(rank)
    fulls = [torch.randn(numel) for _ in range(3)]
    comm.tune([(numel, torch.float32)], torch.device("cpu"))
    offered = comm._pair_ways()
    results = {}
    for way in ("single", "exchange_pair"):
        comm.choice[("reduce_scatter", numel * 4)] = "reduce_scatter_single" if way == "single" else way
        comm.choice[("all_gather", numel * 4)] = "all_gather_single" if way == "single" else way
        outputs = [torch.empty(numel // world) for _ in fulls]
        gathered = [torch.full((numel,), float("nan")) for _ in fulls]
        # three of each in flight at once, as prefetch and the reduction queue may have them, the gathers
        # and the reductions interleaved differently on the two ranks: each must find its own message
        pending = []
        for out, full, into in zip(outputs, fulls, gathered):
            reduce = comm.reduce_scatter(out, full.clone(), async_op=True)
            gather = comm.all_gather(into, full[rank * (numel // world) : (rank + 1) * (numel // world)], async_op=True)
            pending += [reduce, gather] if rank == 0 else [gather, reduce]
        for p in reversed(pending):
            p.wait()
        results[way] = (outputs, gathered)
    same_sums = all(torch.equal(a, b) for a, b in zip(results["single"][0], results["exchange_pair"][0]))
    same_gathers = all(torch.equal(a, b) for a, b in zip(results["single"][1], results["exchange_pair"][1]))
    everyone = [torch.empty(numel) for _ in range(world)]
    dist.all_gather(everyone, fulls[0])
    halves = torch.cat([everyone[r][r * (numel // world) : (r + 1) * (numel // world)] for r in range(world)])
    gathered_right = torch.equal(results["exchange_pair"][1][0], halves)  # each rank's own half, in rank order
    counted = {kind: comm.stats[kind].count for kind in ("reduce_scatter", "all_gather")}
    return {"offered": offered, "same_sums": same_sums, "same_gathers": same_gathers, "gathered_right": gathered_right,
            "counted": counted}  # fmt: skip


def test_two_ranks_may_swap_halves_and_shards_with_the_same_bits():
    for result in run_ranks(_pair_case, 2):
        assert "exchange_pair" in result["offered"]  # tune times it beside the other ways
        assert result["same_sums"]  # bitwise a reduce-scatter's sums, three swaps in flight at once
        assert result["same_gathers"] and result["gathered_right"]  # an all-gather's result
        # counted as reduce-scatters and all-gathers (tuning's own calls are not)
        assert result["counted"] == {"reduce_scatter": 6, "all_gather": 6}


def _tuning_calls_case(rank: int, world: int) -> dict:
    """How many calls ``tune`` makes of each way, where every call takes ``seconds`` (rank 1's: the slowest)."""
    counts: dict[str, int] = {}
    for label, seconds in (("short", 0.001), ("long", 0.2)):
        comm = Communicator()
        calls = []

        def timed(kind, full, shard, warmup, repeats, recorded, comm=comm, calls=calls, seconds=seconds):
            calls.append((kind, comm.choice[(kind, full.numel() * full.element_size())]))
            return [seconds * (2 if rank == 1 else 1) / 2] * repeats  # the long figure only on the slowest rank

        comm._time = timed
        comm.tune([(64, torch.float32)], torch.device("cpu"))
        counts[label] = len(calls)
        counts[f"{label}_ways"] = len(set(calls))  # (kind, way): the pair's swap is a way of both kinds
    return counts


def test_tuning_times_long_calls_in_one_round_and_short_ones_in_several():
    """[Note: long calls are timed once]: a warm-up call of each way, then ``repeats`` (3) rounds where the
    quickest way's warm-up took under 0.1 s on the slowest rank, one round where it took longer; every rank
    makes the same calls (the decision is the slowest rank's, so the other rank's short figures do not split it)."""
    for counts in run_ranks(_tuning_calls_case, 2):
        ways = counts["short_ways"]  # all-gather and reduce-scatter ways, the pair's swap among them
        assert ways == counts["long_ways"] == 6
        assert counts["short"] == ways * (1 + 3)
        assert counts["long"] == ways * (1 + 1)
