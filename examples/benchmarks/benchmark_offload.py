"""Offload figures, measured in one run on this machine, each the median of ``--runs`` repetitions.

Question: What do CPU and NVMe offload cost: the host optimizer step, the swap bandwidth against the disk's, the step time?

    python examples/benchmarks/benchmark_offload.py                 # ~3 minutes on 2 cores
    python examples/benchmarks/benchmark_offload.py --runs 5 --nvme-path /local_nvme

1. **Host optimizer step.** zero3's optimizer step under ``offload_optimizer="cpu"`` (AdamW over the
   offloaded shards, group by group, on torch's fused CPU kernel, with the engine's bookkeeping) against a
   bare ``torch.optim.AdamW(fused=True)`` stepping one tensor of the same number of elements. Target: at
   least 0.8x the bare kernel's throughput.
2. **NVMe swap bandwidth.** The disk's sequential bandwidth, measured here with a plain large file:
   ``pwrite`` in pieces of the swapper's request size, then ``fsync`` (write); the file's pages dropped
   from the page cache (``posix_fadvise(DONTNEED)``, no root needed), then ``preadv`` (read). The swap
   phases are measured the same way: ``engine.states_in_memory()`` reads every group's master and Adam
   moments from cold files (swap-in) and writes them back on exit, followed by ``fsync`` of the swap
   files (swap-out). Target: at least 60% of the disk's figures.
3. **Step time.** A GPT trained by the engine (one process) without offload, with ``"zero3_offload"``'s
   tiers and with ``"zero3_offload_nvme"``'s; the ratio offload / no offload.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # this folder, and examples/ (gpt.py)

from gpt import GPT, GPTConfig, random_tokens  # noqa: E402

from lightning_zero3 import Zero3Config, Zero3Engine  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--adam-params", type=int, default=50_000_000, help="elements stepped in the optimizer test")
    p.add_argument("--swap-params", type=int, default=48_000_000, help="parameters swapped in the NVMe test")
    p.add_argument("--swap-width", type=int, default=2048,
                   help="layer width of the NVMe test: units of width^2 parameters (2048: 16 MiB swap files)")
    p.add_argument("--nvme-path", default=tempfile.gettempdir())
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--json", type=Path, default=Path("benchmark_offload.json"))
    return p.parse_args(argv)


class Layers(nn.Module):
    """``depth`` square layers of ``width``: one unit (flat group) each."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.utils.skip_init(nn.Linear, width, width, bias=False) for _ in range(depth))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return h


def layers_engine(params: int, knobs: dict, width: int = 1024) -> tuple[nn.Module, Zero3Engine, torch.optim.Optimizer]:
    model = Layers(width, max(1, params // width**2))
    for p in model.parameters():
        nn.init.normal_(p, std=width**-0.5)
    engine = Zero3Engine(model, Zero3Config(persistence_threshold=0, tune_collectives=False, **knobs))
    optimizer = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    x = torch.randn(8, width)
    (model(x) - x).pow(2).mean().backward()  # gradients in place for the optimizer steps below
    return model, engine, optimizer


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# -- 1. host optimizer step ------------------------------------------------------------------------


def optimizer_step(args) -> dict:
    _, engine, optimizer = layers_engine(args.adam_params, {"offload_optimizer": "cpu", "offload_params": "cpu"})
    numel = sum(p.numel() for p in engine.shard_params)
    optimizer.step()  # state created: later steps are steady
    zero3 = timed(optimizer.step, 5)
    flat = nn.Parameter(torch.randn(numel))
    flat.grad = torch.randn(numel)
    bare = torch.optim.AdamW([flat], lr=1e-4, fused=True)
    bare.step()
    reference = timed(bare.step, 5)
    engine.close()
    return {"elements": numel, "zero3_s": zero3, "bare_fused_s": reference, "ratio": reference / zero3}


# -- 2. NVMe swap bandwidth --------------------------------------------------------------------------


def _drop_cache(fds) -> None:
    for fd in fds:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def disk_bandwidth(directory: Path, nbytes: int, piece: int) -> dict:
    path = directory / f"zero3-bench-{os.getpid()}.bin"
    block = torch.randint(0, 255, (piece,), dtype=torch.uint8).numpy()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        start = time.perf_counter()
        for offset in range(0, nbytes, piece):
            os.pwrite(fd, memoryview(block)[: min(piece, nbytes - offset)], offset)
        os.fsync(fd)
        write = time.perf_counter() - start
        _drop_cache([fd])
        buffer = memoryview(bytearray(piece))
        start = time.perf_counter()
        for offset in range(0, nbytes, piece):
            os.preadv(fd, [buffer[: min(piece, nbytes - offset)]], offset)
        read = time.perf_counter() - start
    finally:
        os.close(fd)
        path.unlink()
    return {"write_GBps": nbytes / write / 1e9, "read_GBps": nbytes / read / 1e9}


def swap_bandwidth(args) -> dict:
    knobs = {"offload_optimizer": "nvme", "offload_params": "nvme", "nvme_path": args.nvme_path}
    _, engine, optimizer = layers_engine(args.swap_params, knobs, args.swap_width)
    optimizer.step()
    optimizer.zero_grad()  # the swap phases below move masters and Adam's moments: 12 bytes a parameter
    io, swap = engine.offload.io, engine.offload.swap
    fds = [f.fd for f in swap.files]
    figures = {"disk": [], "swap_in": [], "swap_out": []}
    for _ in range(args.runs):
        _drop_cache(fds)
        before = io.stats.read_bytes
        start = time.perf_counter()
        with engine.states_in_memory():
            figures["swap_in"].append((io.stats.read_bytes - before) / (time.perf_counter() - start) / 1e9)
            before, start = io.stats.write_bytes, time.perf_counter()
        for fd in fds:
            os.fsync(fd)
        figures["swap_out"].append((io.stats.write_bytes - before) / (time.perf_counter() - start) / 1e9)
        figures["disk"].append(disk_bandwidth(swap.path, io.stats.write_bytes - before, io.chunk_bytes))
    engine.close()
    disk_w = statistics.median(d["write_GBps"] for d in figures["disk"])
    disk_r = statistics.median(d["read_GBps"] for d in figures["disk"])
    swap_in, swap_out = statistics.median(figures["swap_in"]), statistics.median(figures["swap_out"])
    return {"disk_read_GBps": disk_r, "disk_write_GBps": disk_w, "swap_in_GBps": swap_in, "swap_out_GBps": swap_out,
            "read_share": swap_in / disk_r, "write_share": swap_out / disk_w}  # fmt: skip


# -- 3. step time ------------------------------------------------------------------------------------


def step_times(args) -> dict:
    cfg = GPTConfig(vocab_size=256, block_size=128, n_layer=8, n_head=8, n_embd=448)
    data = random_tokens(64, cfg.block_size, cfg.vocab_size, seed=1)
    modes = {
        "none": {},
        "zero3_offload": {"offload_optimizer": "cpu", "offload_params": "cpu"},
        "zero3_offload_nvme": {"offload_optimizer": "nvme", "offload_params": "nvme", "nvme_path": args.nvme_path},
    }
    result = {}
    for name, knobs in modes.items():
        torch.manual_seed(0)
        model = GPT(cfg)
        engine = Zero3Engine(model, Zero3Config(tune_collectives=False, **knobs))
        optimizer = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        times, losses = [], []
        for step in range(3 + 2 * args.runs):
            x, y = data[(step % 8) * 8 : (step % 8) * 8 + 8]
            start = time.perf_counter()
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
            losses.append(float(loss.detach()))
        engine.close()
        result[name] = {"step_s": statistics.median(times[3:]), "losses": losses}
    for name in modes:
        result[name]["x_no_offload"] = result[name]["step_s"] / result["none"]["step_s"]
        result[name]["loss_max_rel_diff"] = max(
            abs(a - b) / abs(b) for a, b in zip(result[name]["losses"], result["none"]["losses"])
        )
    return result


def main(args) -> dict:
    torch.set_num_threads(args.threads)
    figures = {"optimizer": optimizer_step(args), "swap": swap_bandwidth(args), "steps": step_times(args)}
    o, s, t = figures["optimizer"], figures["swap"], figures["steps"]
    rows = [
        ("host AdamW step (zero3_offload)", f"{o['elements'] / o['zero3_s'] / 1e6:.0f} M elem/s",
         f"bare fused AdamW {o['elements'] / o['bare_fused_s'] / 1e6:.0f} M elem/s", f"{o['ratio']:.2f}x", ">= 0.8x"),
        ("NVMe swap-in (read)", f"{s['swap_in_GBps']:.2f} GB/s", f"disk sequential read {s['disk_read_GBps']:.2f} GB/s",
         f"{s['read_share']:.0%}", ">= 60%"),
        ("NVMe swap-out (write + fsync)", f"{s['swap_out_GBps']:.2f} GB/s",
         f"disk sequential write {s['disk_write_GBps']:.2f} GB/s", f"{s['write_share']:.0%}", ">= 60%"),
    ]  # fmt: skip
    for name in ("zero3_offload", "zero3_offload_nvme"):
        rows.append((f"GPT step, {name}", f"{t[name]['step_s']:.3f} s", f"no offload {t['none']['step_s']:.3f} s",
                     f"{t[name]['x_no_offload']:.2f}x", f"losses {t[name]['loss_max_rel_diff']:.0e}"))  # fmt: skip
    head = ("measure", "zero3", "reference", "ratio", "target / note")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in [head] + rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    print("\n".join(lines))
    print(f"\n{args.threads} threads, median of {args.runs} runs; optimizer test {o['elements'] / 1e6:.0f}M fp32 "
          f"elements; swap test {args.swap_params / 1e6:.0f}M parameters in units of {args.swap_width}^2 under "
          f"{args.nvme_path}")  # fmt: skip
    args.json.write_text(json.dumps(figures, indent=2, default=str))
    return figures


if __name__ == "__main__":
    main(parse_args())
