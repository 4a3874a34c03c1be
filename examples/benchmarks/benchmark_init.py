"""Start-up time and peak memory of sharded initialisation, for a GPT of 1B parameters on 2 CPU ranks.

Question: How long does sharded initialisation of a large model take, and does any rank ever hold the whole model?

    python examples/benchmarks/benchmark_init.py                          # 1.01B parameters: 20 layers x 2048
    python examples/benchmarks/benchmark_init.py --n-layer 24 --n-embd 512   # 76M, what the test runs

Each rank starts its process group, notes its RSS (the *baseline*: interpreter, torch, gloo) and resets
the kernel's high-water mark there (``/proc/self/clear_refs``), then builds the GPT on the meta device
and hands it to ``Zero3Engine``, which materialises it unit by unit straight into shards (rank 0
initialises each unit, it is broadcast, every rank keeps its slice). Printed per rank: the time that
took, the peak RSS since the baseline (``VmHWM``), and the bytes the engine holds (parameter and
gradient shards and the small persistent parameters), with the ratio the test bounds:
(peak - baseline) / shard bytes <= 1.2.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # this folder, and examples/ (gpt.py)

from gpt import GPT, GPTConfig  # noqa: E402

from lightning_zero3 import Zero3Config, Zero3Engine  # noqa: E402
from lightning_zero3.engine.memory.buffers import CATEGORIES  # noqa: E402


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _rank(rank: int, world: int, port: int, shape: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        dist.barrier()
        baseline = _status_kib("VmRSS") * 1024
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS from here on
        start = time.perf_counter()
        with torch.device("meta"):
            model = GPT(GPTConfig(vocab_size=256, block_size=1024, **shape))
        engine = Zero3Engine(model, Zero3Config(), device=torch.device("cpu"), init_fn=GPT._init)
        seconds = time.perf_counter() - start
        peak = _status_kib("VmHWM") * 1024
        shard_bytes = sum(engine.memory_report()[c] for c in CATEGORIES)
        params = sum(p.numel() for p in model.parameters())
        torch.save(
            {"rank": rank, "params": params, "seconds": seconds, "baseline": baseline, "peak": peak,
             "shard_bytes": shard_bytes, "units": len(engine.runtimes)},
            Path(out) / f"rank{rank}.pt",
        )  # fmt: skip
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure(n_layer: int, n_embd: int, n_head: int, world: int = 2) -> list[dict]:
    """Sharded init of a GPT of this shape on ``world`` CPU ranks; one dict of figures per rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    shape = {"n_layer": n_layer, "n_embd": n_embd, "n_head": n_head}
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(world, port, shape, out), nprocs=world, join=True)
        return [torch.load(Path(out) / f"rank{r}.pt") for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-layer", type=int, default=20)
    parser.add_argument("--n-embd", type=int, default=2048)
    parser.add_argument("--n-head", type=int, default=16)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    rows = measure(args.n_layer, args.n_embd, args.n_head, args.world)
    gib = 2**30
    print(f"sharded init of a {rows[0]['params'] / 1e9:.3f}B-parameter GPT ({args.n_layer} layers x {args.n_embd}, "
          f"{rows[0]['units']} flat groups) on {args.world} CPU ranks")  # fmt: skip
    print("rank | start-up s | baseline RSS GiB | peak RSS GiB | shard bytes GiB | (peak - baseline) / shard bytes")
    print("-----+------------+------------------+--------------+-----------------+--------------------------------")
    for r in rows:
        ratio = (r["peak"] - r["baseline"]) / r["shard_bytes"]
        print(f"{r['rank']:<4} | {r['seconds']:<10.1f} | {r['baseline'] / gib:<16.2f} | {r['peak'] / gib:<12.2f} | "
              f"{r['shard_bytes'] / gib:<15.2f} | {ratio:.3f}")  # fmt: skip
    full = rows[0]["params"] * 4 * 2 / gib
    print(f"(the full model with its gradients would be {full:.2f} GiB on every rank)")


if __name__ == "__main__":
    main()
