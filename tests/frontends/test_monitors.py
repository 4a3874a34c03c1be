"""The TensorBoard monitors, read back from the event files of a real 2-rank zero3 run (sharded init)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from distributed import run_script
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_zero3.callbacks import CommMonitor, MemoryMonitor, Zero3MonitorError
from lightning_zero3.engine.memory.buffers import CATEGORIES

SCRIPT = Path(__file__).parents[1] / "scripts" / "monitors_run.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("monitors")
    run_script(SCRIPT, "--out", out)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    events = EventAccumulator(ranks[0]["log_dir"], size_guidance={"tensors": 0, "scalars": 0}).Reload()
    return ranks, events


def _series(events, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in events.Scalars(tag)}


def test_memory_bytes_equal_the_engines_accounting_at_every_logged_step(run):
    ranks, events = run
    reports = [r["reports"] for r in ranks]
    steps = sorted(int(s) for s in reports[0])
    assert steps == [2, 4, 6]
    names = [*CATEGORIES, "peak_gathered_params", "peak_total"]
    assert set(names) <= set(reports[0][str(steps[0])])
    for name in names:
        mean, maximum = (_series(events, f"zero3/memory/{name}_bytes/{how}") for how in ("mean", "max"))
        for step in steps:
            values = [r[str(step)][name] for r in reports]
            assert mean[step] == pytest.approx(sum(values) / 2, rel=1e-6)
            assert maximum[step] == max(values)
    # units really are gathered and released: the peak is positive, nothing is gathered between steps
    assert _series(events, "zero3/memory/peak_gathered_params_bytes/max")[6] > 0
    assert _series(events, "zero3/memory/gathered_params_bytes/max")[6] == 0


def test_fragmentation_is_a_fraction_and_host_figures_are_sane(run):
    ranks, events = run
    for how in ("mean", "max"):
        for value in _series(events, f"zero3/memory/fragmentation/{how}").values():
            assert 0 <= value <= 1
        for value in _series(events, f"zero3/memory/engine_share_of_rss/{how}").values():
            assert 0 < value < 1
    rss = _series(events, "zero3/memory/rss_bytes/max")
    held = sum(ranks[0]["reports"]["6"][c] for c in CATEGORIES)
    assert rss[6] > held  # RSS holds the engine's bytes and the interpreter around them


def test_comm_figures_per_collective_kind(run):
    ranks, events = run
    for kind in ("all_gather", "reduce_scatter"):
        count = _series(events, f"zero3/comm/{kind}/count/mean")
        assert all(c > 0 for c in count.values())
        nbytes = _series(events, f"zero3/comm/{kind}/bytes/mean")
        seconds = _series(events, f"zero3/comm/{kind}/seconds/mean")
        algbw = _series(events, f"zero3/comm/{kind}/algbw_GBps/mean")
        busbw = _series(events, f"zero3/comm/{kind}/busbw_GBps/mean")
        exposed = _series(events, f"zero3/comm/{kind}/exposed_seconds/max")
        for step, bw in busbw.items():
            assert bw > 0
            assert bw == pytest.approx(algbw[step] * (2 - 1) / 2, rel=1e-5)  # nccl-tests, n = 2
            assert nbytes[step] > 0 and seconds[step] > 0 and exposed[step] >= 0
        for how in ("mean", "max"):
            for value in _series(events, f"zero3/comm/{kind}/utilization/{how}").values():
                # logged as it is, no bound: above 1 only says the start-up peak came in low (see
                # test_comm_timing.py for how it moves with the collectives' speed)
                assert 0 < value < math.inf
    for value in _series(events, "zero3/comm/prefetch_hit_rate/mean").values():
        assert 0 <= value <= 1
    assert set(_series(events, "zero3/comm/trace_changes/max").values()) == {0.0}  # a GPT runs alike every step
    # the logged figures are the last ones rank 0 logged
    assert ranks[0]["logged"]["CommMonitor"]["zero3/comm/all_gather/count/mean"] == _series(
        events, "zero3/comm/all_gather/count/mean")[6]  # fmt: skip


def test_advice_and_custom_scalars_layout(run):
    _, events = run
    texts = events.Tags()["tensors"]
    assert "custom_scalars__config__" in texts
    layout = events.Tensors("custom_scalars__config__")[-1].tensor_proto.string_val[0]
    assert b"zero3 memory" in layout and b"zero3 communication" in layout  # one layout holds both
    # fragmentation_threshold=0.001: any heap with free blocks is advised about, naming the knob
    advice = [t for t in texts if t.startswith("zero3/advice/")]
    assert any("fragmentation" in t for t in advice)
    message = events.Tensors(next(t for t in advice if "fragmentation" in t))[0].tensor_proto.string_val[0]
    assert b"max_live_parameters" in message
    for kind in ("all_gather", "reduce_scatter"):
        # advice needs low utilization (and, besides, settings that could still change something)
        low = any(v < 0.7 for v in _series(events, f"zero3/comm/{kind}/utilization/mean").values())
        assert low or not any(f"{kind}_utilization" in t for t in advice)
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "broadcast"):
        tag = f"zero3/comm/{kind}/utilization/mean"
        high = tag in events.Tags()["scalars"] and any(v > 1 for v in _series(events, tag).values())
        assert high == any(f"{kind}_peak" in t for t in advice)  # a beaten peak is flagged, once


def test_sharded_init_in_configure_model_trains(run):
    ranks, _ = run
    assert all(r["built_on_meta"] for r in ranks)
    assert ranks[0]["ln_mean"] == pytest.approx(1.0, abs=0.05)  # reset_parameters() ran
    assert ranks[0]["fc_std"] == pytest.approx(0.02, rel=0.25)  # GPT's own init (its __init__'s, replayed)
    losses = ranks[0]["losses"]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


@pytest.mark.parametrize("changes,steps,advised", [(3.0, 4, True), (2.0, 4, False), (0.0, 0, False)])
def test_advice_when_the_unit_order_changes_in_most_steps(changes, steps, advised):
    monitor = CommMonitor()
    monitor._interval_steps = steps  # what `figures` found for the interval
    advice = dict(monitor.advise({"trace_changes": changes}, {"trace_changes": changes}, trainer=None))
    assert ("trace_changes" in advice) == advised
    if advised:
        assert "3 of the last 4 steps" in advice["trace_changes"] and "prefetch_bucket_size=0" in advice["trace_changes"]


@pytest.mark.parametrize(
    "make,words",
    [
        (lambda: MemoryMonitor(every_n_steps=0), ["every_n_steps"]),
        (lambda: MemoryMonitor(fragmentation_threshold=1.5), ["fragmentation_threshold"]),
        (lambda: CommMonitor(utilization_threshold=0), ["utilization_threshold"]),
    ],
)
def test_bad_monitor_arguments_fail_with_the_argument_named(make, words):
    with pytest.raises(Zero3MonitorError) as error:
        make()
    for word in words:
        assert word in str(error.value)
