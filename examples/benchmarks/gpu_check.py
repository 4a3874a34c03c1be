"""The checks that need a GPU, in one run of a few minutes on one CUDA device:

Question: Does zero3 compute the right numbers on a GPU, and how fast does it step there against one-GPU training and FSDP2?

    python examples/benchmarks/gpu_check.py                 # a table; exit status 1 when any check failed
    python examples/benchmarks/gpu_check.py --json out.json # the same rows as JSON

Without a CUDA device it says so and exits 0, having run nothing. Each check runs in a fresh process on
GPU 0 (Lightning ``Trainer(devices=1)``, so the process group is NCCL with one rank). The correctness
workers share the GPU side by side (their verdicts compare results, not times); the timing probe and the
benchmarks run alone. One process keeps every unit gathered by default, so the correctness checks set
``single_process_sharding=True``: their gathers, releases and reductions run as with several ranks.

- ``parity fp32``: zero3 against DDP, 10 steps of the example GPT: every step's loss and every final
  weight bitwise equal. Both runs use deterministic algorithms and SDPA's math kernel, so the only
  difference left is zero3 itself. ``parity fp32 resident``: the same for zero3's default one-process
  path (every unit gathered for the whole run, the optimizer stepping the buffer the model reads).
- ``parity bf16-mixed``: zero3 against DDP, 20 steps: every loss within ``BF16_LOSS_RTOL`` relative, the
  CPU suite's bound (zero3 gathers bf16 copies of the LayerNorm weights and embeddings, which DDP's
  autocast keeps in fp32; tests/frontends/test_parity.py explains the figure).
- ``offload 16-mixed clip``: ``zero3_offload`` (optimizer and parameters in host memory) against zero3
  without offload, both ``16-mixed`` with ``gradient_clip_val``: the same loss-scale history, losses
  within ``OFFLOAD_LOSS_RTOL`` and weights within ``OFFLOAD_WEIGHT_ATOL``, one AdamW step's worth. The
  host step runs torch's fused CPU AdamW, which rounds differently from the device's by an ulp per
  step; a gradient read before its copy to the host finished moves weights by whole steps. The
  attention's key bias is left out of the weight comparison: softmax ignores a constant added to all of
  a query's scores, so its exact gradient is zero and what it gets is rounding noise, which AdamW
  normalises into full steps whose signs follow the rounding (the CPU suite saw the same). The bounds
  are chosen from that reasoning and a CPU dry run (losses within 5e-6, weights within 1.0e-4 outside
  the key bias, 3.8e-3 in it), not measured on a GPU.
- ``collective timing``: one NCCL all-gather of 1 GiB at one rank, timed by the engine's event clock:
  its time is read only when asked for; waited for at once, the compute stream stalls for most of it
  (unless torch runs the one-rank all-gather as a copy on the calling stream, which the probe detects
  with an event recorded right after the issue: then there is no stall to see, and the row says so);
  issued before a spin kernel that outlasts it, its time is its own (not the spin's) and nothing is
  exposed. Then the start-up peak of that size.
- ``estimate``: ``lightning-zero3 estimate``'s figure for ``ESTIMATE_GPT`` (zero3, 32-true, one device,
  no offload) against ``torch.cuda.max_memory_allocated`` of the same run (``ESTIMATE_STEPS`` steps); the
  estimate's stated CUDA context is left out, which the allocator does not see. An INFO row: estimate,
  measured, ratio (issue 48 holds the CPU estimates to 15%; on a GPU it is a figure until measured).
- ``budget``: the automatic offload plan (``offload_optimizer`` and ``offload_params`` ``"auto"``,
  ``memory_budget`` ``BUDGET_SHARE`` of the peak of the same run without offload, ``nvme_path`` a temporary
  folder) on ``ESTIMATE_GPT`` for ``BUDGET_STEPS`` steps: the whole run's ``torch.cuda.max_memory_allocated``
  within ``BUDGET_SLACK`` of the budget, the losses within ``OFFLOAD_LOSS_RTOL`` of the run without
  offload, and the plan changes it made at step boundaries (docs/will-it-fit.md).
- ``monitors``: ``MemoryMonitor`` and ``CommMonitor`` on under NCCL, gathering on the GPU; the CUDA
  allocator figures and the communication figures they logged last (their ``last_logged``).
- ``benchmark <strategy>``: ``examples/benchmarks/benchmark.py`` on this GPU under zero3, DDP, FSDP2
  (``ModelParallelStrategy``) and plain single-device Lightning (``single``), ``bf16-mixed``: step time,
  tokens/s and model FLOPs utilization,
  MFU = 6 x parameters x tokens/s / peak bf16 FLOP/s (attention's own FLOPs left out, as in the common
  formula, so MFU reads slightly low). The peak comes from ``PEAK_FLOPS`` (NVIDIA's datasheets, dense,
  keyed by device name) or, for a device not listed there, from a timed large bf16 matmul (a lower
  bound of the peak, so MFU against it reads high); the table says which. ``target benchmark``: zero3's
  step against single's, with the project's bound (1.25x).
- ``1B <strategy>`` and ``1B compiled <strategy>``: a GPT of about 1B parameters (20 x 2048, 4096 tokens a
  step), bf16-mixed, at world size 1: zero3, single and FSDP2, eager and then with every block compiled in
  place (``--compile``); ratios to single's step in the same mode, and ``target 1B``: within 1.10x.

- ``85M zero3`` and ``85M single`` (only with ``--parts target``): the 85M GPT of ``benchmark`` under zero3
  and ``single`` alone, three runs each in turn, and ``target 85M``: the world-size-1 bound (1.25x) in
  six processes instead of the benchmark part's eight, for a GPU run that has time for little else.

- ``startup <strategy>`` (only with ``--parts startup``): ``examples/benchmarks/benchmark_startup.py`` on
  this GPU: the fine-tuning job (``finetune_full.yaml``, fp32) on a generated ~1B Llama checkpoint from the
  command's start to the end of its first optimizer step, under zero3, DDP (``from_pretrained``), FSDP2 and
  DeepSpeed stage 3, with the time of each phase (launch, build, read, setup, first step); ``startup
  zero3 x ddp``: zero3's time to the first step against DDP's.

- ``profile <model> <strategy>`` (only with ``--parts profile``): ``examples/benchmarks/device_profile.py`` on the 85M
  GPT (zero3, DDP, single) and the 1B one (zero3, single): per step, the device's busy and idle time, the
  host's waits for it and the costliest kernels.

``--parts`` runs a subset (``checks``, ``big``, ``benchmark``, ``target``, ``profile``, ``startup``; default the first three) in the
order given, for a GPU run too short for all; each part's rows are printed (and ``--json``
rewritten) as soon as the part ends, so a run cut short still reports what it measured.

``--accelerator cpu`` runs the same checks on the CPU: a dry run of this script's own machinery (the
CUDA-only figures and the NCCL check are then reported missing or skipped).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # this folder, and examples/ (gpt.py, data.py)

from processes import free_port  # noqa: E402

BF16_LOSS_RTOL = 5e-3
OFFLOAD_LOSS_RTOL = 1e-3
OFFLOAD_WEIGHT_ATOL = 1e-3  # one AdamW step of the example's lr (1e-3)
WORKER_TIMEOUT_S = 300
BENCHMARK_TIMEOUT_S = 600

#: Dense peak FLOP/s (bf16 tensor core, fp32 without tensor cores) from NVIDIA's datasheets, by a part of
#: ``torch.cuda.get_device_name()``; the first match wins, so longer names come first.
PEAK_FLOPS = (
    ("H200 NVL", 835e12, 60e12),
    ("H200", 989e12, 67e12),
    ("H100 NVL", 835e12, 60e12),
    ("H100 PCIe", 756e12, 51e12),
    ("H100", 989e12, 67e12),  # SXM: "NVIDIA H100 80GB HBM3"
    ("A100", 312e12, 19.5e12),
    ("L40S", 362e12, 91.6e12),
    ("L4", 121e12, 30.3e12),
)

#: the model of the correctness checks (the CPU parity suite's shape, a little wider)
PARITY_GPT = dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
BATCH = 8
#: the ``estimate`` check's model (the benchmark's 85M shape) and run: the estimate against the allocator's peak
ESTIMATE_GPT = dict(vocab_size=256, block_size=512, n_layer=12, n_head=12, n_embd=768)
ESTIMATE_BATCH, ESTIMATE_STEPS = 8, 5
#: the ``budget`` check: the estimate's model under the automatic plan, its budget this share of the same run's
#: peak without offload (a budget that needs offload), held to within ``BUDGET_SLACK`` over the whole run
BUDGET_SHARE, BUDGET_SLACK, BUDGET_STEPS = 0.8, 0.03, 8
#: examples/benchmarks/benchmark.py's arguments: a GPT of 85M parameters, 8192 tokens a step
BENCHMARK = {"cuda": ["--n-layer", "12", "--n-embd", "768", "--n-head", "12", "--block-size", "512", "--batch-size", "16",
                      "--steps", "30", "--warmup", "10", "--runs", "2"],
             "cpu": ["--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--block-size", "32", "--batch-size", "4",
                     "--steps", "5", "--warmup", "2", "--runs", "1"]}  # fmt: skip
BENCHMARK_STRATEGIES = ("zero3", "ddp", "fsdp2", "single")
#: the ``target`` part: the 85M GPT under zero3 and single alone, a run more each than the benchmark part
TARGET_RUNS = 3
TARGET_STRATEGIES = ("zero3", "single")
#: the world-size-1 comparison: a GPT of about 1B parameters (20 x 2048, 1.07B with its 32000-token
#: embedding), 4096 tokens a step, eager and with every block compiled
BIG = {"cuda": ["--n-layer", "20", "--n-embd", "2048", "--n-head", "16", "--block-size", "1024", "--batch-size", "4",
                "--vocab-size", "32000", "--steps", "15", "--warmup", "5", "--runs", "1"],
       "cpu": ["--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--block-size", "32", "--batch-size", "4",
               "--steps", "3", "--warmup", "1", "--runs", "1"]}  # fmt: skip
BIG_STRATEGIES = ("zero3", "single", "fsdp2")
#: zero3's step at world size 1 against plain single-device Lightning's, at most (the project's targets)
TARGET_X_SINGLE = {"benchmark": 1.25, "1B": 1.10}
PARTS = ("checks", "big", "benchmark", "target", "profile", "startup")
# asked for by name: the profile (5 more runs, not yet timed on a GPU), and the target part (what the
# benchmark part measures too, alone, for a short GPU run)
DEFAULT_PARTS = ("checks", "big", "benchmark")
#: the startup part: examples/benchmarks/benchmark_startup.py at one device (a ~1B Llama on the GPU)
STARTUP = {"cuda": ["--ranks", "1", "--runs", "1"], "cpu": ["--quick", "--ranks", "1"]}
#: the profile part: examples/benchmarks/device_profile.py at one device, per model, the strategies it compares
PROFILES = {"85M": (BENCHMARK, ("zero3", "ddp", "single")), "1B": (BIG, ("zero3", "single"))}


@dataclass
class Row:
    check: str
    status: str  # "PASS", "FAIL", or "INFO" (a figure, not a verdict)
    detail: str


# ---------------------------------------------------------------------------------------------------
# the verdicts (pure functions of the workers' results)


def compare_exact(a: dict, b: dict) -> tuple[bool, str]:
    """Whether two runs' per-step losses and final weights are bitwise equal; where they first differ."""
    for step, (x, y) in enumerate(zip(a["losses"], b["losses"])):
        if x != y:
            return False, f"step {step} loss {x!r} vs {y!r}"
    if len(a["losses"]) != len(b["losses"]):
        return False, f"{len(a['losses'])} vs {len(b['losses'])} steps"
    if a["weights"].keys() != b["weights"].keys():
        return False, f"different weights: {sorted(a['weights'].keys() ^ b['weights'].keys())}"
    for name, weight in a["weights"].items():
        if not torch.equal(weight, b["weights"][name]):
            return False, f"weight {name} differs by up to {_max_abs_diff(weight, b['weights'][name]):.1e}"
    return True, f"{len(a['losses'])} losses and {len(a['weights'])} weights bitwise equal"


def compare_close(a: dict, b: dict, loss_rtol: float, weight_atol: Optional[float] = None) -> tuple[bool, str]:
    """Whether every step's loss agrees within ``loss_rtol`` (relative) and every weight within ``weight_atol``."""
    if len(a["losses"]) != len(b["losses"]) or not a["losses"]:
        return False, f"{len(a['losses'])} vs {len(b['losses'])} steps"
    loss = max(abs(x - y) / abs(y) for x, y in zip(a["losses"], b["losses"]))
    ok, detail = loss <= loss_rtol, f"losses within {loss:.1e} relative (bound {loss_rtol:.0e})"
    if weight_atol is not None:
        weight = max(_max_abs_diff(w, b["weights"][name]) for name, w in a["weights"].items())
        ok = ok and weight <= weight_atol
        detail += f", weights within {weight:.1e} (bound {weight_atol:.0e})"
    return ok, detail


def without_key_bias(result: dict, n_embd: int) -> dict:
    """``result`` with each attention's key bias (the middle third of ``attn.bias``) left out of its weights."""
    weights = {name: torch.cat([w[:n_embd], w[2 * n_embd :]]) if name.endswith("attn.bias") else w
               for name, w in result["weights"].items()}  # fmt: skip
    return {**result, "weights": weights}


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def trains(result: dict) -> bool:
    return all(math.isfinite(x) for x in result["losses"]) and result["losses"][-1] < result["losses"][0]


def timing_verdict(t: dict) -> tuple[bool, str]:
    """The collective-timing probe's figures against what event timing must show (see ``collective_timing``)."""
    problems = []
    if t["pending_after_wait"] < 1:
        problems.append("times were read on the hot path")
    if not 0 < t["alone_s"] <= t["alone_host_s"]:
        problems.append("time of a lone collective outside (0, host time]")
    inline = t["inline_s"] >= 0.5 * t["alone_s"]  # torch ran the one-rank "collective" as a copy on the caller's stream
    if not inline and t["alone_exposed_s"] < 0.5 * t["alone_s"]:
        problems.append("waiting at once exposed less than half of it")
    if t["overlapped_s"] > 0.5 * t["spin_s"]:
        problems.append("an overlapped collective was timed to its wait, not its completion")
    if t["overlapped_exposed_s"] > 0.25 * t["alone_s"]:
        problems.append("an overlapped collective counted as exposed")
    if not 0 < t["peak_busbw"] < math.inf:
        problems.append("no peak")
    detail = (f"1 GiB all-gather {t['alone_s'] * 1e3:.2f} ms (host saw {t['alone_host_s'] * 1e3:.2f} ms), exposed "
              f"{t['alone_exposed_s'] * 1e3:.2f} ms; behind a {t['spin_s'] * 1e3:.0f} ms spin: {t['overlapped_s'] * 1e3:.2f} "
              f"ms, exposed {t['overlapped_exposed_s'] * 1e3:.3f} ms; peak busbw {t['peak_busbw'] / 1e9:.0f} GB/s")  # fmt: skip
    if inline:
        detail += ("; at one rank the copy ran on the calling stream (nothing to wait for), so the exposed time of a "
                   "waited collective is not observable here: unverified until a multi-GPU run")  # fmt: skip
    return not problems, "; ".join(problems + [detail])


CUDA_MEMORY_TAGS = ("reserved_bytes", "allocated_bytes", "fragmentation", "cached_slack", "alloc_retries")


def monitors_verdict(memory: dict, comm: dict) -> tuple[bool, str]:
    """The monitors' last logged figures: the CUDA allocator's present and sane, the collectives' measured.
    The check runs at one rank, where the gathers (sharded on purpose) are one-rank collectives and the
    gradients are reduced with none ([Note: one rank reduces nothing] in engine/grads/reduction.py): a reduce-scatter
    counted there is a defect."""
    mem = {tag: memory.get(f"zero3/memory/{tag}/max") for tag in CUDA_MEMORY_TAGS}
    missing = [tag for tag, value in mem.items() if value is None]
    problems = [f"memory figures missing: {missing}"] if missing else []
    if not missing:
        if not 0 < mem["allocated_bytes"] <= mem["reserved_bytes"]:
            problems.append("allocated outside (0, reserved]")
        if not (0 <= mem["fragmentation"] <= 1 and 0 <= mem["cached_slack"] <= 1 and mem["alloc_retries"] >= 0):
            problems.append("allocator fractions out of range")
    parts = [] if missing else [
        f"reserved {mem['reserved_bytes'] / 2**20:.0f} MiB, allocated {mem['allocated_bytes'] / 2**20:.0f} MiB, "
        f"fragmentation {mem['fragmentation']:.3f}, slack {mem['cached_slack']:.2f}, retries {mem['alloc_retries']:.0f}"
    ]  # fmt: skip
    names = ("count", "bytes", "seconds", "busbw_GBps", "utilization")
    fig = {name: comm.get(f"zero3/comm/all_gather/{name}/mean") for name in names}
    if None in fig.values() or not (fig["count"] > 0 < fig["seconds"] and 0 < fig["utilization"] < math.inf):
        problems.append(f"all_gather figures missing or not positive: {fig}")
    else:
        parts.append(f"all_gather {fig['count']:.0f} calls, {fig['bytes'] / 2**20:.1f} MiB, {fig['seconds'] * 1e3:.2f} ms, "
                     f"busbw {fig['busbw_GBps']:.0f} GB/s, utilization {fig['utilization']:.2f}")  # fmt: skip
    reduce_scatters = comm.get("zero3/comm/reduce_scatter/count/mean")
    if reduce_scatters:
        problems.append(f"{reduce_scatters:.0f} reduce-scatters at one rank (expected none)")
    else:
        parts.append("no reduce-scatter (one rank)")
    return not problems, "; ".join(problems + parts)


def mfu(params: int, tokens_per_s: float, peak_flops: float) -> float:
    """Model FLOPs utilization: 6 FLOPs per parameter per token (forward 2, backward 4) against the peak."""
    return 6 * params * tokens_per_s / peak_flops


def table_peak(device_name: str, dtype: torch.dtype) -> Optional[float]:
    for part, bf16, fp32 in PEAK_FLOPS:
        if part in device_name:
            return bf16 if dtype == torch.bfloat16 else fp32
    return None


def benchmark_rows(summary: dict, params: int, peak: Optional[float], strategies: tuple[str, ...] = ("zero3", "ddp", "fsdp2"),
                   label: str = "benchmark", reference: str = "ddp") -> list[Row]:  # fmt: skip
    """One row per strategy: step time, its ratio to ``reference``'s, tokens/s and MFU (FAIL: no result)."""
    rows = []
    base = summary["rows"].get(reference, {}).get("step_time_s", math.nan)
    name = "DDP" if reference == "ddp" else reference
    for strategy in strategies:
        row = summary["rows"].get(strategy)
        if row is None:
            why = summary["skipped"].get(strategy, "no result")
            rows.append(Row(f"{label} {strategy}", "FAIL", why.splitlines()[0][:200]))
            continue
        utilization = f"MFU {mfu(params, row['tokens_per_s'], peak):.1%}" if peak else "MFU n/a (no peak figure)"
        rows.append(Row(f"{label} {strategy}", "INFO",
                        f"step {row['step_time_s'] * 1e3:.1f} ms ({row['step_time_s'] / base:.2f}x {name}), "
                        f"{row['tokens_per_s']:,.0f} tokens/s, {utilization}"))  # fmt: skip
    return rows


def target_row(summary: dict, label: str, bound: float) -> Row:
    """zero3's step against plain single-device Lightning's, and whether it is within ``bound`` (a figure
    to read, not a verdict on the code: INFO either way)."""
    rows = summary["rows"]
    if "zero3" not in rows or "single" not in rows:
        return Row(f"target {label}", "INFO", "not measured (zero3 or single has no result)")
    ratio = rows["zero3"]["step_time_s"] / rows["single"]["step_time_s"]
    verdict = "met" if ratio <= bound else "missed"
    return Row(f"target {label}", "INFO", f"zero3 {ratio:.2f}x single's step, target <= {bound:.2f}x: {verdict}")


def format_table(rows: list[Row]) -> str:
    head = Row("check", "result", "details")
    widths = [max(len(getattr(r, f)) for r in [head, *rows]) for f in ("check", "status")]
    lines = [f"{r.check:<{widths[0]}} | {r.status:<{widths[1]}} | {r.detail}" for r in [head, *rows]]
    lines.insert(1, f"{'-' * widths[0]}-+-{'-' * widths[1]}-+-{'-' * 7}")
    return "\n".join(lines)


def exit_status(rows: list[Row]) -> int:
    return 1 if any(r.status == "FAIL" for r in rows) else 0


# ---------------------------------------------------------------------------------------------------
# the parent: one worker process per run, then the verdicts


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        torch.save(run_worker(args.worker, args.accelerator), args.out)
        return 0
    if args.accelerator == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device found (torch.cuda.is_available() is False); nothing was run.")
        return 0
    global LOG_DIR
    LOG_DIR = args.logs
    signal.signal(signal.SIGTERM, _end_children_and_exit)
    started = time.perf_counter()
    print(describe_machine(args.accelerator), flush=True)
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise SystemExit(f"gpu_check: --parts {args.parts!r}: unknown {unknown}; choose from {', '.join(PARTS)}")
    jobs = args.jobs or (len(CONCURRENT_WORKERS) if args.accelerator == "cuda" else 2)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        for part in dict.fromkeys(parts):  # in the order given, each once
            part_started = time.perf_counter()
            if part == "checks":
                new = verdicts(run_checks(args.accelerator, Path(tmp), jobs))
            elif part == "benchmark":
                new = benchmark(args.accelerator, Path(tmp))
            elif part == "big":
                new = big_benchmark(args.accelerator, Path(tmp))
            elif part == "target":
                new = target(args.accelerator, Path(tmp))
            elif part == "startup":
                new = startup(args.accelerator, Path(tmp))
            else:
                new = device_profiles(args.accelerator, Path(tmp))
            rows += new
            # each part's rows as soon as it ends, so a run cut short still reports what it measured
            print(f"\n{format_table(new)}\n({part}: {time.perf_counter() - part_started:.0f} s)\n", flush=True)
            if args.json:
                args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    print()
    print(format_table(rows))
    print(f"\n{time.perf_counter() - started:.0f} s")
    return exit_status(rows)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accelerator", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--json", type=Path)
    p.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                   help=f"comma-separated, of {', '.join(PARTS)}, run in the order given: the correctness checks, "
                        "the ~1B world-size-1 comparison (eager and compiled), the 85M benchmark, the 85M GPT under "
                        "zero3 and single alone, where the step's time goes on the device (examples/benchmarks/device_profile.py); "
                        f"default {','.join(DEFAULT_PARTS)}")
    p.add_argument("--jobs", type=int, default=0,
                   help="correctness workers run side by side (default: all of them on a GPU, 2 on the CPU); the "
                        "timing probe and the benchmarks always run alone")
    p.add_argument("--logs", type=Path, help="keep each child process's whole output here, one file per run")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def describe_machine(accelerator: str) -> str:
    if accelerator == "cpu":
        return f"gpu_check dry run on the CPU, torch {torch.__version__}"
    return f"gpu_check on {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}"


#: where each child process's whole output is kept (``--logs``), beside the table's three-line tails
LOG_DIR: Optional[Path] = None
#: the process ids of the children running now (the correctness workers run side by side, from threads)
_RUNNING: set[int] = set()


def _end_children_and_exit(signum: int, frame: Any) -> None:
    """A TERM (``timeout``, a job's time limit): end every running child's process group first,
    so that nothing this script started outlives it, then exit."""
    for pid in list(_RUNNING):
        _end_group(pid)
    sys.exit(128 + signum)


def _end_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # it ended by itself meanwhile


def run_child(name: str, cmd: list[str], timeout: float, **kwargs: Any) -> Optional[str]:
    """Run one child process; None when it exited 0, else why not (its exit status and last lines).

    Its output goes to its log file (``--logs``) as it is written, so a run cut short (by this
    timeout, or by a job's time limit) still leaves the lines each child printed so far: the
    benchmark prints every run's step time as that run ends. The child starts a process group of
    its own (``start_new_session``), and ends with everything it started: a benchmark's worker processes hold the output pipe
    of whatever waits on this script, and killing the benchmark alone left them running to the end."""
    print(f"running {name} ...", flush=True)
    if LOG_DIR is not None:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
    log_path = LOG_DIR / f"{name.replace(' ', '_')}.log" if LOG_DIR is not None else None
    with (open(log_path, "w+") if log_path is not None else tempfile.TemporaryFile("w+")) as log:
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True, **kwargs)
        _RUNNING.add(child.pid)
        try:
            code: Optional[int] = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if child.poll() is None:
                _end_group(child.pid)
                child.wait()
            _RUNNING.discard(child.pid)
        log.seek(0)
        output = log.read()
    if code is None:
        return f"{name}: no result after {timeout:.0f} s"
    if code != 0:
        tail = output.strip().splitlines()[-3:]
        return f"{name}: exit {code}: {' / '.join(tail)[-300:]}"
    return None


def launch(name: str, accelerator: str, tmp: Path) -> Any:
    """A worker's result, or the reason it has none (a string)."""
    out = tmp / f"{name}.pt"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--accelerator", accelerator, "--out", str(out)]
    failed = run_child(name, cmd, WORKER_TIMEOUT_S, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if failed or not out.exists():
        return failed or f"{name}: exit 0 without a result"
    return torch.load(out, weights_only=False)


def run_checks(accelerator: str, tmp: Path, jobs: int) -> dict[str, Any]:
    """Every correctness worker's result (or why it has none). Their verdicts compare results, not times,
    so they share the device side by side; the timing probe then runs alone, since a spin kernel next to
    other processes' kernels would not time what it claims to."""
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        runs = dict(zip(CONCURRENT_WORKERS, pool.map(lambda name: launch(name, accelerator, tmp), CONCURRENT_WORKERS)))
    runs["timing"] = launch("timing", accelerator, tmp)
    runs["estimate"] = launch("estimate", accelerator, tmp)  # alone too: its own allocator peak, whole device free
    runs["budget"] = launch("budget", accelerator, tmp)  # alone: the allocator's peak against a budget
    return runs


def verdicts(runs: dict[str, Any]) -> list[Row]:
    rows = []

    def row(check: str, names: tuple[str, ...], judge) -> None:
        failed = [runs[n] for n in names if isinstance(runs[n], str)]
        if failed:
            rows.append(Row(check, "FAIL", failed[0]))
            return
        if isinstance(runs[names[0]], dict) and runs[names[0]].get("skipped"):
            rows.append(Row(check, "INFO", runs[names[0]]["skipped"]))
            return
        ok, detail = judge(*(runs[n] for n in names))
        rows.append(Row(check, "PASS" if ok else "FAIL", detail))

    def with_training(ok_detail: tuple[bool, str], *results: dict) -> tuple[bool, str]:
        ok, detail = ok_detail
        if not all(trains(r) for r in results):
            return False, "losses did not fall; " + detail
        return ok, detail

    row("parity fp32", ("zero3-fp32", "ddp-fp32"), lambda z, d: with_training(compare_exact(z, d), z))
    row("parity fp32 resident", ("zero3-fp32-resident", "ddp-fp32"), lambda z, d: with_training(compare_exact(z, d), z))
    row("parity bf16-mixed", ("zero3-bf16", "ddp-bf16"),
        lambda z, d: with_training(compare_close(z, d, BF16_LOSS_RTOL), z))  # fmt: skip

    def offload(o: dict, z: dict) -> tuple[bool, str]:
        if o["scales"] != z["scales"]:
            return False, f"loss scales {o['scales']} vs {z['scales']}"
        n_embd = PARITY_GPT["n_embd"]
        ok, detail = compare_close(without_key_bias(o, n_embd), without_key_bias(z, n_embd), OFFLOAD_LOSS_RTOL,
                                   OFFLOAD_WEIGHT_ATOL)  # fmt: skip
        return with_training((ok, f"same loss scales ({z['scales'][-1]} at the end); {detail}"), o)

    row("offload 16-mixed clip", ("offload-fp16-clip", "zero3-fp16-clip"), offload)
    row("collective timing", ("timing",), timing_verdict)
    row("monitors", ("monitors",), lambda m: monitors_verdict(m["memory"], m["comm"]))
    if "estimate" in runs:
        row("estimate", ("estimate",), estimate_row)
    if "budget" in runs:
        row("budget", ("budget",), budget_verdict)
    return rows


def estimate_row(result: dict) -> tuple[bool, str]:
    """The estimate against the allocator's measured peak: a figure (the row is INFO, never a verdict)."""
    estimate, measured = result["estimate"], result["measured"]
    ratio = estimate / measured if measured else float("inf")
    return True, (f"estimate {estimate / 2**20:,.0f} MiB, measured max_memory_allocated {measured / 2**20:,.0f} MiB, "
                  f"ratio {ratio:.2f} ({'within' if abs(ratio - 1) <= 0.15 else 'outside'} 15%; "
                  f"{result['model']}, CUDA context left out)")  # fmt: skip


def budget_verdict(result: dict) -> tuple[bool, str]:
    """The whole run's allocator peak under the automatic plan within ``BUDGET_SLACK`` of its budget, with the
    losses of the run without offload."""
    budget, peak = result["budget"], result["peak"]
    losses, resident = result["losses"], result["resident_losses"]
    same = len(losses) == len(resident) and all(
        abs(a - b) <= OFFLOAD_LOSS_RTOL * abs(b) for a, b in zip(losses, resident)
    )  # fmt: skip
    held = peak <= budget * (1 + BUDGET_SLACK)
    changes = ", ".join(f"step {c['step']}: level {c['level']}" for c in result["changes"]) or "none"
    return held and same, (f"peak {peak / 2**20:,.0f} MiB of a {budget / 2**20:,.0f} MiB budget "
                           f"({peak / budget:.3f}x, {'within' if held else 'over'} {BUDGET_SLACK:.0%}); losses "
                           f"{'within' if same else 'NOT within'} {OFFLOAD_LOSS_RTOL} of no offload; plan changes: {changes}")  # fmt: skip


def benchmark(accelerator: str, tmp: Path) -> list[Row]:
    """The 85M GPT under zero3, DDP, FSDP2 and plain single-device Lightning."""
    return timed_rows("benchmark", BENCHMARK[accelerator], BENCHMARK_STRATEGIES, accelerator, tmp, "ddp")


def target(accelerator: str, tmp: Path) -> list[Row]:
    """The 85M GPT under zero3 and plain single-device Lightning only: the world-size-1 target alone."""
    options = [*_without_option(BENCHMARK[accelerator], "--runs"), "--runs", str(TARGET_RUNS)]
    return timed_rows("85M", options, TARGET_STRATEGIES, accelerator, tmp, "single", "benchmark")


def big_benchmark(accelerator: str, tmp: Path) -> list[Row]:
    """The ~1B GPT at world size 1: zero3, plain single-device Lightning and FSDP2, eager, then with every
    block compiled in place; ratios to single's step of the same mode."""
    rows = []
    for label, extra in (("1B", []), ("1B compiled", ["--compile"])):
        rows += timed_rows(label, BIG[accelerator] + extra, BIG_STRATEGIES, accelerator, tmp, "single", "1B")
    return rows


def timed_rows(label: str, options: list[str], strategies: tuple[str, ...], accelerator: str, tmp: Path,
               reference: str, target_of: Optional[str] = None) -> list[Row]:  # fmt: skip
    """One ``examples/benchmarks/benchmark.py`` run: its header row, a row per strategy (ratios to ``reference``'s
    step) and zero3's target row against the bound ``TARGET_X_SINGLE[target_of or label]``."""
    summary, params, header = run_benchmark(label, options, strategies, accelerator, tmp)
    if summary is None:
        return [header]
    rows = benchmark_rows(summary, params, peak_flops(accelerator)[0], strategies, label, reference)
    return [header, *rows, target_row(summary, label, TARGET_X_SINGLE[target_of or label])]


def startup(accelerator: str, tmp: Path) -> list[Row]:
    """``examples/benchmarks/benchmark_startup.py`` at one device: per strategy, the time from the command's
    start to the end of the fine-tune's first optimizer step and its phases (INFO rows)."""
    out = tmp / "startup.json"
    cmd = [sys.executable, str(HERE / "benchmark_startup.py"), "--accelerator", accelerator, "--json", str(out),
           "--dir", str(tmp / "startup"), *STARTUP[accelerator]]  # fmt: skip
    failed = run_child("startup", cmd, BENCHMARK_TIMEOUT_S, cwd=tmp)
    if failed or not out.exists():
        return [Row("startup", "FAIL", failed or "exit 0 without a result")]
    return startup_rows(json.loads(out.read_text()))


def startup_rows(result: dict) -> list[Row]:
    """The rows of a ``benchmark_startup.py`` result: its header, one per strategy, zero3 against DDP."""
    from benchmark_startup import PHASES, phases

    table = result["table"]
    rows, totals = [Row("startup", "INFO", table[0])], {}
    for strategy, runs in result["rows"].items():
        good = [phases(r["ranks"]) for r in runs if isinstance(r, dict)]
        if not good:
            rows.append(Row(f"startup {strategy}", "FAIL" if strategy == "zero3" else "INFO", runs[-1][:300]))
            continue
        figures = good[0]
        totals[strategy] = figures["total"]
        detail = ", ".join(f"{p} {figures[p]:.2f} s" for p in PHASES)
        rows.append(Row(f"startup {strategy}", "INFO", f"{figures['total']:.2f} s to the first step ({detail})"))
    if "zero3" in totals and "ddp" in totals:
        rows.append(Row("startup zero3 x ddp", "INFO", f"{totals['zero3'] / totals['ddp']:.2f}x DDP's time to the first step"))
    return rows


def device_profiles(accelerator: str, tmp: Path) -> list[Row]:
    """``examples/benchmarks/device_profile.py`` at one device, ``bf16-mixed``: per model and strategy, the step's
    device-busy and idle time, host syncs and costliest kernels (INFO rows: figures to read)."""
    rows = []
    for label, (options, strategies) in PROFILES.items():
        for strategy in strategies:
            name = f"profile {label} {strategy}"
            out = tmp / f"{name.replace(' ', '_')}.json"
            model = options[accelerator]
            for flag in ("--runs", "--steps", "--warmup"):  # the profile's own step counts instead
                model = _without_option(model, flag)
            cmd = [sys.executable, str(HERE / "device_profile.py"), "--strategy", strategy, "--json", str(out),
                   "--accelerator", accelerator, "--precision", "bf16-mixed", "--steps", "3", "--warmup", "5", *model]  # fmt: skip
            failed = run_child(name, cmd, BENCHMARK_TIMEOUT_S, cwd=tmp)
            if failed or not out.exists():
                rows.append(Row(name, "FAIL", failed or "exit 0 without a result"))
                continue
            from device_profile import describe

            rows.append(Row(name, "INFO", describe(strategy, json.loads(out.read_text()))))
    return rows


def _without_option(options: list[str], flag: str) -> list[str]:
    """``options`` less ``flag`` and the value after it."""
    if flag not in options:
        return options
    i = options.index(flag)
    return options[:i] + options[i + 2 :]


def run_benchmark(label: str, options: list[str], strategies: tuple[str, ...], accelerator: str,
                  tmp: Path) -> tuple[Optional[dict], int, Row]:  # fmt: skip
    """``examples/benchmarks/benchmark.py`` at one device in bf16-mixed: (its summary or None, the model's parameter
    count, a header row saying what ran or why it failed)."""
    from gpt import GPT, GPTConfig, count_parameters

    out = tmp / f"{label.replace(' ', '_')}.json"
    cmd = [sys.executable, str(HERE / "benchmark.py"), "--accelerator", accelerator, "--devices", "1",
           "--precision", "bf16-mixed", "--strategies", ",".join(strategies), "--json", str(out), *options]  # fmt: skip
    failed = run_child(label, cmd, BENCHMARK_TIMEOUT_S, cwd=tmp)
    if failed or not out.exists():
        return None, 0, Row(label, "FAIL", failed or "exit 0 without a result")
    summary = json.loads(out.read_text())
    cfg = summary["config"]
    with torch.device("meta"):
        params = count_parameters(GPT(GPTConfig(vocab_size=cfg["vocab_size"], block_size=cfg["block_size"],
                                                n_layer=cfg["n_layer"], n_head=cfg["n_head"], n_embd=cfg["n_embd"])))  # fmt: skip
    source = peak_flops(accelerator)[1]
    compiled = ", every block compiled" if cfg.get("compile") else ""
    shape = f"GPT {params / 1e6:.1f}M parameters, {cfg['batch_size'] * cfg['block_size']} tokens a step, bf16-mixed{compiled}"
    return summary, params, Row(label, "INFO", f"{shape}; peak {source}")


@functools.lru_cache(maxsize=None)  # timed once per run where the datasheet has no figure
def peak_flops(accelerator: str) -> tuple[Optional[float], str]:
    if accelerator != "cuda":
        return None, "n/a on the CPU"
    name = torch.cuda.get_device_name(0)
    listed = table_peak(name, torch.bfloat16)
    if listed is not None:
        return listed, f"{listed / 1e12:.0f} TFLOP/s bf16 dense, datasheet figure for {name}"
    measured = measured_matmul_flops()
    return measured, f"{measured / 1e12:.0f} TFLOP/s, a timed 8192^3 bf16 matmul ({name} is not in PEAK_FLOPS)"


def measured_matmul_flops(n: int = 8192, repeats: int = 10) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    end.synchronize()
    return 2 * n**3 * repeats / (start.elapsed_time(end) / 1e3)


# ---------------------------------------------------------------------------------------------------
# the workers: one run each, in a fresh process

# worker -> (strategy, precision flag, steps, gradient_clip_val)
TRAINING = {
    "zero3-fp32": ("zero3", "32-true", 10, None),
    "zero3-fp32-resident": ("zero3_resident", "32-true", 10, None),
    "ddp-fp32": ("ddp", "32-true", 10, None),
    "zero3-bf16": ("zero3", "bf16-mixed", 20, None),
    "ddp-bf16": ("ddp", "bf16-mixed", 20, None),
    "offload-fp16-clip": ("zero3_offload", "16-mixed", 10, 0.5),
    "zero3-fp16-clip": ("zero3", "16-mixed", 10, 0.5),
}
CONCURRENT_WORKERS = (*TRAINING, "monitors")  # "timing" runs after them, alone


def run_worker(name: str, accelerator: str) -> dict:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before CUDA starts
    if name == "timing":
        return collective_timing() if accelerator == "cuda" else {"skipped": "skipped: needs NCCL on CUDA"}
    if name == "monitors":
        return monitors_run(accelerator)
    if name == "budget":
        if accelerator != "cuda":
            return {"skipped": "skipped: holds torch.cuda.max_memory_allocated to a budget (needs CUDA)"}
        return budget_run()
    if name == "estimate":
        if accelerator != "cuda":
            return {"skipped": "skipped: compares with torch.cuda.max_memory_allocated (needs CUDA)"}
        return estimate_run()
    strategy, precision, steps, clip = TRAINING[name]
    return train(strategy, precision, steps, clip, accelerator)


def train(strategy: str, precision: str, steps: int, clip: Optional[float], accelerator: str,
          callbacks: tuple = (), logger: Any = False, gpt: Optional[dict] = None, batch: int = BATCH,
          settings: Optional[dict] = None) -> dict:  # fmt: skip
    import lightning.pytorch as pl
    from gpt import GPTConfig, GPTModule, random_tokens
    from torch.utils.data import DataLoader

    import lightning_zero3

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.scales: list[Optional[float]] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.losses.append(float(outputs["loss"].detach()))
            scaler = getattr(trainer.strategy.precision_plugin, "scaler", None)
            self.scales.append(getattr(scaler, "scale", None))

    if accelerator == "cuda":  # SDPA's math kernel: deterministic, so runs can match bit for bit
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
    # One process keeps every unit gathered by default (nothing to shard); these checks shard anyway, so the
    # gathers, releases and reductions run as with several ranks (NCCL at one rank, the side streams), and
    # small parameters are sharded too, as in the CPU parity suite. "zero3_resident" is the default path.
    knobs = {"persistence_threshold": 1000, "single_process_sharding": True}
    if strategy == "zero3_resident":
        knobs = {}
    if strategy == "zero3_offload":
        knobs |= {"offload_optimizer": "cpu", "offload_params": "cpu"}
    knobs |= settings or {}
    chosen = "ddp" if strategy == "ddp" else lightning_zero3.Zero3Strategy(**knobs)
    flags: dict = {"precision": precision}
    if accelerator == "cpu" and precision == "16-mixed":  # Lightning turns the flag into bf16 on the CPU
        flags = {"plugins": [lightning_zero3.Zero3Precision(precision)]}
    pl.seed_everything(1234)
    cfg = GPTConfig(**(gpt or PARITY_GPT))
    model, record = GPTModule(cfg), Record()
    trainer = pl.Trainer(strategy=chosen, accelerator=accelerator, devices=1, **flags, max_steps=steps,
                         gradient_clip_val=clip, deterministic="warn", logger=logger, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[record, *callbacks])  # fmt: skip
    data = random_tokens(steps * batch, cfg.block_size, cfg.vocab_size, seed=7)
    trainer.fit(model, DataLoader(data, batch_size=batch, shuffle=False))
    engine = lightning_zero3.engine_of(model)  # zero3 keeps the model sharded after fit: ask for full weights
    state = engine.full_state_dict() if engine is not None else model.state_dict()
    weights = {k: v.detach().cpu().clone() for k, v in state.items()}
    plan = engine.dynamic_plan if engine is not None else None
    return {"losses": record.losses, "scales": record.scales, "weights": weights,
            "changes": plan.changes if plan is not None else []}  # fmt: skip


def estimate_run() -> dict:
    """The estimator's device figure for ``ESTIMATE_GPT`` under the correctness checks' zero3 settings (one
    device, 32-true, no offload), less its stated CUDA context, and the run's ``torch.cuda.max_memory_allocated``."""
    from gpt import GPTConfig, GPTModule

    from lightning_zero3 import Zero3Config
    from lightning_zero3.engine.plan.estimate import Job, estimate_plans
    from lightning_zero3.engine.plan.facts import measure_activations, model_facts

    cfg = Zero3Config(persistence_threshold=1000, single_process_sharding=True)  # train()'s zero3 settings
    with torch.device("meta"):
        module = GPTModule(GPTConfig(**ESTIMATE_GPT))
    tokens = torch.zeros(ESTIMATE_BATCH, ESTIMATE_GPT["block_size"], dtype=torch.long, device="meta")
    facts = model_facts(module, cfg.unit_modules, cfg.persistence_threshold, 1)
    activations = measure_activations(module, lambda: module.model.loss(tokens, tokens), unit_modules=cfg.unit_modules,
                                      persistence_threshold=cfg.persistence_threshold, seq_len=tokens.shape[1])  # fmt: skip
    job = Job(world_size=1, ranks_per_node=1, prefetch_numel=cfg.prefetch_bucket_size,
              max_live_numel=cfg.max_live_parameters, buffer_count=cfg.offload_buffer_count,
              baseline_device=0)  # the allocator does not see the CUDA context  # fmt: skip
    [none] = [e for e in estimate_plans(facts, activations, job) if e.offload_optimizer is None and e.offload_params is None]
    torch.cuda.reset_peak_memory_stats(0)
    train("zero3", "32-true", ESTIMATE_STEPS, None, "cuda", gpt=ESTIMATE_GPT, batch=ESTIMATE_BATCH)
    return {"estimate": none.device_bytes_per_rank, "measured": torch.cuda.max_memory_allocated(0),
            "model": f"GPT {facts.total_numel / 1e6:.0f}M, batch {ESTIMATE_BATCH} x {ESTIMATE_GPT['block_size']}"}


def budget_run() -> dict:
    """``ESTIMATE_GPT`` without offload, then under the automatic plan with a budget below that run's peak."""
    torch.cuda.reset_peak_memory_stats(0)
    resident = train("zero3", "32-true", BUDGET_STEPS, None, "cuda", gpt=ESTIMATE_GPT, batch=ESTIMATE_BATCH)
    budget = int(BUDGET_SHARE * torch.cuda.max_memory_allocated(0))
    with tempfile.TemporaryDirectory() as swap:
        auto = {"offload_optimizer": "auto", "offload_params": "auto", "memory_budget": budget, "nvme_path": swap}
        gc.collect()  # the first run's model and engine go before the second measures its baseline
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(0)
        offloaded = train("zero3", "32-true", BUDGET_STEPS, None, "cuda", gpt=ESTIMATE_GPT, batch=ESTIMATE_BATCH,
                          settings=auto)  # fmt: skip
        peak = torch.cuda.max_memory_allocated(0)
    return {"budget": budget, "peak": peak, "losses": offloaded["losses"], "resident_losses": resident["losses"],
            "changes": offloaded["changes"]}  # fmt: skip


def monitors_run(accelerator: str) -> dict:
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_zero3.callbacks import CommMonitor, MemoryMonitor

    memory, comm = MemoryMonitor(every_n_steps=2), CommMonitor(every_n_steps=2)
    with tempfile.TemporaryDirectory() as logs:
        train("zero3", "32-true", 6, None, accelerator, callbacks=(memory, comm), logger=TensorBoardLogger(logs))
    return {"memory": memory.last_logged, "comm": comm.last_logged}


def collective_timing() -> dict:
    """An NCCL all-gather at one rank, through the engine's Communicator and its event clock."""
    import torch.distributed as dist

    from lightning_zero3.engine.comm.communicator import Communicator

    class OneRankNCCL(Communicator):
        distributed = True  # issue real NCCL collectives (at one rank, a copy on NCCL's stream or the caller's)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        comm = OneRankNCCL()
        full, shard = torch.empty(1 << 28, device="cuda"), torch.ones(1 << 28, device="cuda")  # 1 GiB
        comm.all_gather(full, shard)  # NCCL's first call sets up
        comm.reset_stats()
        torch.cuda.synchronize()
        host = time.perf_counter()
        before, issued = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        pending = comm.all_gather(full, shard, async_op=True)
        issued.record()  # on the compute stream: it passes this point at once unless the copy ran on it
        pending.wait()  # waited for at once
        pending_after_wait = comm.pending_timings
        torch.cuda.synchronize()
        host = time.perf_counter() - host
        alone = comm.stats["all_gather"]
        result = {"pending_after_wait": pending_after_wait, "alone_host_s": host, "alone_s": alone.seconds,
                  "alone_exposed_s": alone.exposed_seconds, "inline_s": before.elapsed_time(issued) / 1e3}  # fmt: skip
        comm.reset_stats()
        cycles, spin_s = _spin_cycles(0.05)
        pending = comm.all_gather(full, shard, async_op=True)
        torch.cuda._sleep(cycles)  # one block spinning on the compute stream: the collective runs beside it
        pending.wait()
        overlapped = comm.stats["all_gather"]
        result |= {"spin_s": spin_s, "overlapped_s": overlapped.seconds,
                   "overlapped_exposed_s": overlapped.exposed_seconds}  # fmt: skip
        result["peak_busbw"] = comm.measure_peaks()[("all_gather", full.numel() * 4)]
        return result
    finally:
        dist.destroy_process_group()


def _spin_cycles(seconds: float) -> tuple[int, float]:
    """GPU clock cycles that ``torch.cuda._sleep`` spins for about ``seconds``, and the seconds they took."""

    def timed(cycles: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    probe = 10_000_000
    cycles = int(probe * seconds / timed(probe))
    return cycles, timed(cycles)




if __name__ == "__main__":
    sys.exit(main())
