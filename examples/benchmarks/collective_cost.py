"""What each collective costs on this host: wall time and CPU time per call, at one unit's size.

Question: What does each collective cost on this host, in wall time and CPU time, at one unit's size?

    python examples/benchmarks/collective_cost.py                       # one block of the benchmark GPT (2.41M fp32), 2 CPU ranks
    python examples/benchmarks/collective_cost.py --numel 1000000 --world-size 4 --repeats 30

On CPU ranks the collectives' copies run on the same cores as the compute, so what a step pays for
communication is their CPU time, not how much of it overlaps. The table gives, per call, the median
wall time and the median CPU time of rank 0's process (every thread: gloo's own included) of each way
zero3 and DDP move a unit's parameters or gradients:

- ``all_gather`` (``all_gather_single``) and, on two ranks, ``swap shards`` (point-to-point): the
  ways zero3 may gather a unit, before its forward and again before its backward;
- ``reduce_scatter`` (``reduce_scatter_single``), ``all_reduce + slice`` and, on two ranks, ``swap
  halves`` (point-to-point): the ways zero3 may reduce a unit's gradients (``tune_collectives`` times
  them at start-up and keeps the fastest);
- ``all_reduce``: DDP reduces every gradient once.

Below the table, per unit and step: zero3's CPU time (two of the cheaper gathers and the cheaper reduction) against
DDP's (one all-reduce). Each call starts after a barrier, so each runs alone, as ``tune_collectives``
times them.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BENCHMARK_BLOCK = 12 * 448 * 448 + 13 * 448  # one block of examples/benchmarks/benchmark.py's GPT (8 x 448)
GATHERS = ("all_gather", "swap shards")  # the ways zero3 may gather a unit
REDUCTIONS = ("reduce_scatter", "all_reduce + slice", "swap halves")  # ... and reduce its gradients


def _timed(call: Callable[[], object], repeats: int, warmup: int = 2) -> tuple[float, float]:
    """Median wall and CPU milliseconds of ``call`` over ``repeats`` calls, each after a barrier."""
    wall, cpu = [], []
    for index in range(warmup + repeats):
        dist.barrier()
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        call()
        if index >= warmup:
            wall.append(time.perf_counter() - start_wall)
            cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3


def _rank(rank: int, world: int, port: int, numel: int, repeats: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    numel = -(-numel // world) * world  # padded to a multiple of the ranks, as a flat unit is
    full, gathered = torch.randn(numel), torch.empty(numel)
    shard = torch.empty(numel // world)

    def all_reduce_slice() -> None:
        dist.all_reduce(full)
        shard.copy_(full[rank * shard.numel() : (rank + 1) * shard.numel()])

    width, peer = shard.numel(), 1 - rank

    def swap(send: torch.Tensor, receive: torch.Tensor) -> list:
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, receive, peer)])

    def swap_halves() -> None:  # two ranks: [Note: a pair swaps halves] in lightning_zero3/engine/comm/communicator.py
        for work in swap(full[peer * width : (peer + 1) * width], shard):
            work.wait()
        shard.add_(full[rank * width : (rank + 1) * width])

    def swap_shards() -> None:  # two ranks: [Note: a pair swaps shards] in lightning_zero3/engine/comm/communicator.py
        works = swap(shard, gathered[peer * width : (peer + 1) * width])
        gathered[rank * width : (rank + 1) * width].copy_(shard)
        for work in works:
            work.wait()

    rows = {"all_gather": _timed(lambda: dist.all_gather_single(gathered, shard), repeats)}
    if world == 2:
        rows["swap shards"] = _timed(swap_shards, repeats)
    rows["reduce_scatter"] = _timed(lambda: dist.reduce_scatter_single(shard, full), repeats)
    rows["all_reduce + slice"] = _timed(all_reduce_slice, repeats)
    if world == 2:
        rows["swap halves"] = _timed(swap_halves, repeats)
    rows["all_reduce"] = _timed(lambda: dist.all_reduce(full), repeats)
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def measure(numel: int, world: int, repeats: int) -> dict[str, tuple[float, float]]:
    """``{way: (wall ms, CPU ms)}`` of rank 0, each collective at ``numel`` fp32 elements."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    mp.start_processes(_rank, args=(world, port, numel, repeats, queue), nprocs=world, start_method="spawn")
    return queue.get()


def table(rows: dict[str, tuple[float, float]], numel: int, world: int) -> str:
    lines = [f"{'collective':<20} | wall ms | CPU ms", f"{'-' * 20}-+---------+-------"]
    lines += [f"{way:<20} | {wall:7.2f} | {cpu:6.2f}" for way, (wall, cpu) in rows.items()]
    gather_cpu = min(cpu for way, (_, cpu) in rows.items() if way in GATHERS)
    reduce_cpu = min(cpu for way, (_, cpu) in rows.items() if way in REDUCTIONS)
    zero3, ddp = 2 * gather_cpu + reduce_cpu, rows["all_reduce"][1]
    lines.append("")
    lines.append(
        f"per unit of {numel} fp32 elements and step, {world} ranks: zero3 {zero3:.2f} ms of CPU (2 of the cheaper "
        f"gather + the cheaper reduction), DDP {ddp:.2f} ms (1 all-reduce): {zero3 / ddp:.2f}x"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=BENCHMARK_BLOCK, help="elements of one unit (fp32)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    print(table(measure(args.numel, args.world_size, args.repeats), args.numel, args.world_size))


if __name__ == "__main__":
    main()
