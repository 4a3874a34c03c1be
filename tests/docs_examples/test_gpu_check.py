"""examples/benchmarks/gpu_check.py: without CUDA it runs nothing and exits 0; its verdicts and table, on made-up results."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import gpu_check
import pytest
import torch
from gpu_check import Row

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "benchmarks" / "gpu_check.py"


def test_without_cuda_it_says_so_and_runs_nothing():
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120,
                          env={"PATH": "", "CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no CUDA device found" in done.stdout and "nothing was run" in done.stdout
    assert "running" not in done.stdout


def _run(losses, **weights) -> dict:
    return {"losses": losses, "weights": {k: torch.tensor(v) for k, v in weights.items()}, "scales": [None]}


def test_bitwise_comparison_names_the_first_difference():
    a = _run([3.0, 2.0, 1.0], w=[1.0, 2.0])
    assert gpu_check.compare_exact(a, _run([3.0, 2.0, 1.0], w=[1.0, 2.0])) == (True, "3 losses and 1 weights bitwise equal")
    ok, detail = gpu_check.compare_exact(a, _run([3.0, math.nextafter(2.0, 3.0), 1.0], w=[1.0, 2.0]))
    assert not ok and detail.startswith("step 1 loss")  # one ulp is a difference
    ok, detail = gpu_check.compare_exact(a, _run([3.0, 2.0, 1.0], w=[1.0, 2.5]))
    assert not ok and detail == "weight w differs by up to 5.0e-01"


def test_tolerance_comparison_and_training_check():
    a = _run([3.0, 2.0], w=[1.0])
    ok, detail = gpu_check.compare_close(a, _run([3.0, 2.002], w=[1.0005]), loss_rtol=5e-3, weight_atol=1e-3)
    assert ok and "losses within 1.0e-03" in detail and "weights within 5.0e-04" in detail
    assert not gpu_check.compare_close(a, _run([3.0, 2.02], w=[1.0]), loss_rtol=5e-3)[0]
    assert not gpu_check.compare_close(a, _run([3.0, 2.0], w=[1.01]), loss_rtol=5e-3, weight_atol=1e-3)[0]
    assert gpu_check.trains(a) and not gpu_check.trains(_run([2.0, 3.0])) and not gpu_check.trains(_run([3.0, math.nan]))


def test_key_bias_is_left_out_of_the_offload_weight_comparison():
    n = 2  # q, k, v biases of 2 each
    a = {"losses": [1.0], "weights": {"blocks.0.attn.bias": torch.zeros(3 * n), "blocks.0.fc.bias": torch.zeros(2)}}
    b = {"losses": [1.0], "weights": {"blocks.0.attn.bias": torch.tensor([0, 0, 9, 9, 0, 0.0]), "blocks.0.fc.bias": torch.zeros(2)}}
    assert not gpu_check.compare_close(a, b, 1e-3, 1e-3)[0]
    assert gpu_check.compare_close(gpu_check.without_key_bias(a, n), gpu_check.without_key_bias(b, n), 1e-3, 1e-3)[0]
    b["weights"]["blocks.0.attn.bias"][0] = 9.0  # the query bias still counts
    assert not gpu_check.compare_close(gpu_check.without_key_bias(a, n), gpu_check.without_key_bias(b, n), 1e-3, 1e-3)[0]


TIMING = {"pending_after_wait": 1, "alone_host_s": 0.0012, "alone_s": 0.0010, "alone_exposed_s": 0.0009,
          "spin_s": 0.05, "overlapped_s": 0.0011, "overlapped_exposed_s": 0.00001, "peak_busbw": 2e12,
          "inline_s": 0.00001}  # fmt: skip


@pytest.mark.parametrize(
    "change,words",
    [
        ({}, None),
        ({"pending_after_wait": 0}, "read on the hot path"),
        ({"overlapped_s": 0.051}, "timed to its wait"),  # the old host stamp: charged the spin
        ({"overlapped_exposed_s": 0.0009}, "counted as exposed"),
        ({"alone_exposed_s": 0.0001}, "exposed less than half"),
        ({"alone_host_s": 0.0009}, "outside (0, host time]"),
    ],
)
def test_collective_timing_verdict(change, words):
    ok, detail = gpu_check.timing_verdict({**TIMING, **change})
    assert ok is (words is None)
    assert "1 GiB all-gather 1.00 ms" in detail and "peak busbw 2000 GB/s" in detail
    if words:
        assert words in detail


def test_a_one_rank_copy_on_the_calling_stream_has_no_stall_to_check():
    """The H200 run: torch ran the one-rank all-gather on the calling stream (the event recorded right
    after the issue completed only after the copy), so nothing waited and exposure cannot be seen."""
    inline = {**TIMING, "alone_exposed_s": 0.0, "inline_s": 0.0009}
    ok, detail = gpu_check.timing_verdict(inline)
    assert ok and "copy ran on the calling stream" in detail
    ok, detail = gpu_check.timing_verdict({**inline, "inline_s": 0.0001})  # on NCCL's stream: a stall is due
    assert not ok and "exposed less than half" in detail


def test_monitors_verdict_needs_the_cuda_allocator_figures():
    comm = {f"zero3/comm/all_gather/{name}/mean": value
            for name, value in (("count", 12), ("bytes", 2**21), ("seconds", 0.003), ("busbw_GBps", 50), ("utilization", 0.8))}  # fmt: skip
    cuda = {"reserved_bytes": 2**30, "allocated_bytes": 2**29, "fragmentation": 0.01, "cached_slack": 0.5, "alloc_retries": 0}
    memory = {f"zero3/memory/{tag}/max": value for tag, value in cuda.items()}
    ok, detail = gpu_check.monitors_verdict(memory, comm)
    assert ok and "reserved 1024 MiB, allocated 512 MiB" in detail and "all_gather 12 calls, 2.0 MiB, 3.00 ms" in detail
    ok, detail = gpu_check.monitors_verdict({"zero3/memory/rss_bytes/max": 1.0}, comm)  # host figures only
    assert not ok and "memory figures missing" in detail
    assert "no reduce-scatter (one rank)" in detail
    ok, detail = gpu_check.monitors_verdict(memory, {**comm, "zero3/comm/all_gather/count/mean": 0})
    assert not ok and "all_gather figures missing or not positive" in detail
    # one rank reduces without a collective: a reduce-scatter counted there fails the check
    ok, detail = gpu_check.monitors_verdict(memory, {**comm, "zero3/comm/reduce_scatter/count/mean": 2})
    assert not ok and "2 reduce-scatters at one rank (expected none)" in detail


def test_mfu_and_the_peak_table():
    assert gpu_check.mfu(100e6, 1e5, 1e15) == pytest.approx(0.06)  # 6 * 1e8 * 1e5 / 1e15
    assert gpu_check.table_peak("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989e12
    assert gpu_check.table_peak("NVIDIA H100 PCIe", torch.bfloat16) == 756e12
    assert gpu_check.table_peak("NVIDIA H200", torch.float32) == 67e12
    assert gpu_check.table_peak("NVIDIA L40S", torch.bfloat16) == 362e12  # not the L4's
    assert gpu_check.table_peak("Some Future GPU", torch.bfloat16) is None


def test_benchmark_rows_table_and_exit_status():
    summary = {
        "rows": {"zero3": {"step_time_s": 0.02, "tokens_per_s": 4.0e5, "step_time_x_ddp": 1.25},
                 "ddp": {"step_time_s": 0.016, "tokens_per_s": 5.0e5, "step_time_x_ddp": 1.0}},
        "skipped": {"fsdp2": "failed (exit 1): out of memory\nmore"},
    }  # fmt: skip
    rows = gpu_check.benchmark_rows(summary, params=100_000_000, peak=1e15)
    assert rows[0] == Row("benchmark zero3", "INFO", "step 20.0 ms (1.25x DDP), 400,000 tokens/s, MFU 24.0%")
    assert rows[1].detail.endswith("MFU 30.0%")
    assert rows[2] == Row("benchmark fsdp2", "FAIL", "failed (exit 1): out of memory")
    assert gpu_check.benchmark_rows(summary, 100_000_000, None)[0].detail.endswith("MFU n/a (no peak figure)")
    table = gpu_check.format_table([Row("parity fp32", "PASS", "equal"), *rows]).splitlines()
    assert table[0].startswith("check           | result |") and set(table[1]) <= {"-", "+"}
    assert table[2] == "parity fp32     | PASS   | equal"
    assert len({line.index("|") for line in table if "|" in line}) == 1  # columns line up
    assert gpu_check.exit_status(rows) == 1 and gpu_check.exit_status(rows[:2]) == 0


def test_world_size_one_rows_compare_with_plain_single_device_lightning():
    summary = {"rows": {"zero3": {"step_time_s": 0.105, "tokens_per_s": 39000.0},
                        "single": {"step_time_s": 0.100, "tokens_per_s": 41000.0}},
               "skipped": {"fsdp2": "failed (exit 1): out of memory"}}  # fmt: skip
    rows = gpu_check.benchmark_rows(summary, 1_000_000_000, 989e12, gpu_check.BIG_STRATEGIES, "1B", reference="single")
    assert rows[0] == Row("1B zero3", "INFO", "step 105.0 ms (1.05x single), 39,000 tokens/s, MFU 23.7%")
    assert rows[1].detail.startswith("step 100.0 ms (1.00x single)") and rows[2].status == "FAIL"
    assert gpu_check.target_row(summary, "1B", 1.10) == Row("target 1B", "INFO", "zero3 1.05x single's step, target <= 1.10x: met")
    slow = {**summary, "rows": {**summary["rows"], "zero3": {"step_time_s": 0.12, "tokens_per_s": 1.0}}}
    assert gpu_check.target_row(slow, "1B", 1.10).detail.endswith("target <= 1.10x: missed")
    assert "not measured" in gpu_check.target_row({"rows": {"zero3": {}}}, "1B", 1.10).detail


def test_the_target_part_times_the_85m_gpt_under_zero3_and_single_alone(tmp_path, monkeypatch):
    ran = []

    def fake_run_benchmark(label, options, strategies, accelerator, tmp):
        ran.append((label, options, strategies))
        summary = {"rows": {"zero3": {"step_time_s": 0.026, "tokens_per_s": 3.1e5},
                            "single": {"step_time_s": 0.021, "tokens_per_s": 3.9e5}}, "skipped": {}}  # fmt: skip
        return summary, 85_600_000, Row(label, "INFO", "GPT 85.6M parameters")

    monkeypatch.setattr(gpu_check, "run_benchmark", fake_run_benchmark)
    monkeypatch.setattr(gpu_check, "peak_flops", lambda accelerator: (989e12, "datasheet"))
    rows = gpu_check.target("cuda", tmp_path)
    [(label, options, strategies)] = ran
    assert label == "85M" and strategies == ("zero3", "single")
    # the benchmark part's model and steps, three runs instead of two
    assert options == [*gpu_check.BENCHMARK["cuda"][:-2], "--runs", "3"]
    assert gpu_check.BENCHMARK["cuda"][-2:] == ["--runs", "2"]
    assert [row.check for row in rows] == ["85M", "85M zero3", "85M single", "target 85M"]
    assert rows[1].detail.startswith("step 26.0 ms (1.24x single)")
    assert rows[3].detail == "zero3 1.24x single's step, target <= 1.25x: met"
    assert "target" in gpu_check.PARTS and "target" not in gpu_check.DEFAULT_PARTS


def test_the_device_profile_counts_busy_time_once_where_kernels_overlap():
    from types import SimpleNamespace

    import device_profile
    from torch.autograd import DeviceType

    assert device_profile.busy_seconds([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.8)]) == 4.0

    def event(name, start_us, end_us, device=DeviceType.CUDA):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start_us, end=end_us))

    events = [event("gemm", 0, 4000), event("gemm", 6000, 10000), event("copy", 3000, 5000),
              event("cudaStreamSynchronize", 0, 10, DeviceType.CPU), event("aten::mm", 0, 10, DeviceType.CPU)]  # fmt: skip
    figures = device_profile.summarize(events, wall_s=0.024, steps=2)  # two steps of 12 ms, 9 ms of it busy
    assert figures["wall_s"] == pytest.approx(0.012)
    assert figures["busy_s"] == pytest.approx(0.0045) and figures["idle_s"] == pytest.approx(0.0075)
    assert figures["syncs"] == 0.5 and figures["kernels"] == 1.5
    assert figures["top"][0] == ("gemm", pytest.approx(0.004))
    line = device_profile.describe("zero3", figures)
    assert "step 12.0 ms, device busy 4.5 ms, idle 7.5 ms" in line and "gemm 4.0 ms" in line
    on_cpu = device_profile.summarize([event("aten::mm", 0, 10, DeviceType.CPU)], wall_s=0.01, steps=1)
    assert on_cpu["busy_s"] is None and "device busy n/a" in device_profile.describe("single", on_cpu)
    assert gpu_check._without_option(["--a", "1", "--steps", "30", "--b"], "--steps") == ["--a", "1", "--b"]


def _benchmark_like(pid_file: Path) -> str:
    """A child that starts a worker of its own, prints a run's line and then never ends."""
    return ("import subprocess, sys, time\n"
            "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            f"open({str(pid_file)!r}, 'w').write(str(worker.pid))\n"
            "print('run 1/2 zero3: median step 0.020 s', flush=True)\n"
            "time.sleep(600)\n")  # fmt: skip


def _assert_ended(pid_file: Path) -> None:
    worker = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    stat = Path(f"/proc/{worker}/stat")
    while stat.exists() and stat.read_text().split()[2] != "Z" and time.monotonic() < deadline:
        time.sleep(0.1)  # killed (then reaped, or a zombie until its new parent reaps it)
    assert not stat.exists() or stat.read_text().split()[2] == "Z", "the worker outlived the child"


def test_a_child_cut_short_leaves_its_lines_and_nothing_running(tmp_path, monkeypatch):
    """A benchmark that outlives its timeout: what it printed so far is in its log, and the worker it
    started is ended with it (not left holding the caller's output pipe)."""
    monkeypatch.setattr(gpu_check, "LOG_DIR", tmp_path / "logs")
    started = time.monotonic()
    failed = gpu_check.run_child("benchmark", [sys.executable, "-c", _benchmark_like(tmp_path / "pid")], timeout=2)
    assert time.monotonic() - started < 30
    assert failed == "benchmark: no result after 2 s"
    assert "run 1/2 zero3: median step 0.020 s" in (tmp_path / "logs" / "benchmark.log").read_text()
    _assert_ended(tmp_path / "pid")


def test_a_terminated_check_ends_the_children_it_started(tmp_path):
    """``timeout`` (a TERM) ends gpu_check.py while a child runs: the child and its worker end with it."""
    pid_file = tmp_path / "pid"
    script = (f"import signal, sys; sys.path.insert(0, {str(SCRIPT.parent)!r}); import gpu_check\n"
              "signal.signal(signal.SIGTERM, gpu_check._end_children_and_exit)\n"
              f"gpu_check.run_child('benchmark', [sys.executable, '-c', {_benchmark_like(pid_file)!r}], timeout=600)\n")  # fmt: skip
    check = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    check.terminate()
    output, _ = check.communicate(timeout=30)  # the pipe closes only once no child holds it
    assert check.returncode == 128 + signal.SIGTERM, output.decode(errors="replace")[-2000:]
    _assert_ended(pid_file)


def test_a_failed_child_reports_its_exit_and_last_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "LOG_DIR", None)
    script = "import sys; print('loading'); sys.exit('benchmark: CUDA out of memory')"
    assert gpu_check.run_child("1B", [sys.executable, "-c", script], timeout=60) == (
        "1B: exit 1: loading / benchmark: CUDA out of memory"
    )
    assert gpu_check.run_child("ok", [sys.executable, "-c", "print('fine')"], timeout=60) is None


def test_the_estimate_row_states_estimate_measured_and_ratio_and_is_skipped_without_cuda():
    ok, detail = gpu_check.estimate_row({"estimate": 3 * 2**30, "measured": 2**31 + 2**30 // 2, "model": "GPT 85M"})
    assert ok and detail.startswith("estimate 3,072 MiB, measured max_memory_allocated 2,560 MiB, ratio 1.20 (outside 15%")
    assert gpu_check.run_worker("estimate", "cpu")["skipped"].startswith("skipped")
    rows = gpu_check.verdicts({**{n: "not run" for n in (*gpu_check.CONCURRENT_WORKERS, "timing")},
                               "estimate": {"skipped": "skipped: needs CUDA"}})  # fmt: skip
    assert rows[-1] == Row("estimate", "INFO", "skipped: needs CUDA")


def test_the_budget_row_holds_the_whole_run_peak_to_the_budget_with_the_losses_of_no_offload():
    run = {"budget": 1000 * 2**20, "peak": 1020 * 2**20, "losses": [2.0, 1.5], "resident_losses": [2.0, 1.5],
           "changes": [{"step": 1, "level": 1}]}  # fmt: skip
    ok, detail = gpu_check.budget_verdict(run)
    assert ok and detail.startswith("peak 1,020 MiB of a 1,000 MiB budget (1.020x, within 3%)")
    assert detail.endswith("plan changes: step 1: level 1")
    assert not gpu_check.budget_verdict({**run, "peak": 1040 * 2**20})[0]
    assert not gpu_check.budget_verdict({**run, "losses": [2.0, 1.6]})[0]
    assert gpu_check.run_worker("budget", "cpu")["skipped"].startswith("skipped")
    rows = gpu_check.verdicts({**{n: "not run" for n in (*gpu_check.CONCURRENT_WORKERS, "timing", "estimate")},
                               "budget": {"skipped": "skipped: needs CUDA"}})  # fmt: skip
    assert rows[-1] == Row("budget", "INFO", "skipped: needs CUDA")


def _startup_rank(total: float) -> dict:
    return {"imported": 2.0, "launched": 3.0, "configure_start": 3.5, "configure_end": 4.0, "engine_ready": 5.0,
            "first_batch": 5.5, "first_step_end": total, "read_in_configure": 0.1, "read_in_setup": 0.4}  # fmt: skip


def test_the_startup_part_reports_each_phase_and_zero3_against_ddp():
    result = {"table": ["time to the first step: ..."],
              "rows": {"zero3": [{"ranks": [_startup_rank(6.0), _startup_rank(6.5)]}],
                       "ddp": [{"ranks": [_startup_rank(13.0)]}],
                       "deepspeed": ["failed: RuntimeError: ..."]}}  # fmt: skip
    rows = gpu_check.startup_rows(result)
    assert [row.check for row in rows] == ["startup", "startup zero3", "startup ddp", "startup deepspeed", "startup zero3 x ddp"]
    assert rows[1].detail.startswith("6.50 s to the first step (launch 3.00 s, build 0.40 s, read 0.50 s, setup 0.60 s")
    assert rows[3] == Row("startup deepspeed", "INFO", "failed: RuntimeError: ...")
    assert rows[4].detail == "0.50x DDP's time to the first step"
    failed = gpu_check.startup_rows({"table": ["t"], "rows": {"zero3": ["failed: no first step within 600 s"]}})
    assert failed[1].status == "FAIL"
    assert "startup" in gpu_check.PARTS and "startup" not in gpu_check.DEFAULT_PARTS
