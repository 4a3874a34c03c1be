"""Sharded checkpoint speed against the disk, and the memory of consolidating a 1B-parameter model.

Question: How close to the disk's own bandwidth do sharded checkpoints save and load, and what does consolidation cost in memory?

    python examples/benchmarks/benchmark_checkpoint.py                  # 2 ranks, ~85M-parameter GPT, 1.3B consolidation
    python examples/benchmarks/benchmark_checkpoint.py --runs 5 --dir /local_nvme/bench

Three measurements, in one run, in a scratch directory on the disk under test (``--dir``):

1. The disk: one process writes a file of ``--disk-gb`` GB sequentially in 64 MiB blocks and fsyncs it
   (write bandwidth), evicts it from the page cache with ``posix_fadvise(DONTNEED)`` (advice about this
   file only; no machine setting is touched) and reads it back (cold read bandwidth).
2. Save and load: ``--devices`` ranks (gloo) shard a GPT with zero3, take one AdamW step (so the optimizer
   holds its moments), then save a sharded checkpoint (each rank writes its own file, fsynced) and load
   it back after evicting its files from the page cache the same way. Throughput = checkpoint bytes /
   wall time of the slowest rank; median of ``--runs``; ratio to the disk's bandwidth from (1).
3. Consolidation: a checkpoint of a GPT-shaped model with ``--big-layers`` x ``--big-embd`` (1.27B
   parameters by default) is generated on disk by the ranks without training (each writes only its
   halves), then consolidated to one ``.pt`` file in a fresh process from a cold page cache, whose peak
   resident memory (the OS's VmHWM) is compared with its baseline and with the largest tensor.

Checksums: (2) and (3) are each done with checksums (written with every file, checked before a load or
consolidation changes anything) and without (``checksums=False`` / ``verify=False``), alternating which
goes first and syncing the disk before each save, and the table gives both medians and their ratio, each
arm's spread over the runs (min / median / max: the host's own noise, against which a ratio is judged),
and the growth of a rank's peak resident memory during each load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # this folder, and examples/ (gpt.py, data.py)

BLOCK = 64 << 20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=None, help="scratch directory on the disk to measure (default: a temp dir)")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--disk-gb", type=float, default=2.0)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--big-layers", type=int, default=24)
    p.add_argument("--big-embd", type=int, default=2048)
    p.add_argument("--big-vocab", type=int, default=32000)
    p.add_argument("--big-runs", type=int, default=1, help="runs of the 1B save and consolidation (each writes 2 x 5 GB)")
    p.add_argument("--skip-consolidation", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


# -- 1. the disk ----------------------------------------------------------------------------------


def evict(paths) -> None:
    """Drop these files' pages from the page cache, so the next read comes from the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_under(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if p.is_file()]


def disk_bandwidth(directory: Path, nbytes: int) -> tuple[float, float]:
    data = os.urandom(BLOCK)
    path = directory / "disk.bin"
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as out:
        for _ in range(max(1, nbytes // BLOCK)):
            out.write(data)
        os.fsync(out.fileno())
    write = path.stat().st_size / (time.perf_counter() - start)
    evict([path])
    buffer = bytearray(BLOCK)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as inp:
        while inp.readinto(buffer):
            pass
    read = path.stat().st_size / (time.perf_counter() - start)
    path.unlink()
    return write, read


# -- 2. save and load ------------------------------------------------------------------------------


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _save_load_worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    from gpt import GPT, GPTConfig

    from lightning_zero3 import Zero3Config, Zero3Engine
    from lightning_zero3.checkpoint import load_sharded_checkpoint, save_sharded_checkpoint

    _init(rank, world, port)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=args.n_layer, n_head=max(1, args.n_embd // 64), n_embd=args.n_embd)
    model = GPT(cfg)
    engine = Zero3Engine(model, Zero3Config(tune_collectives=False))
    optimizer = engine.shard_optimizer(torch.optim.AdamW(model.parameters()))
    model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    optimizer.step()
    warm = Path(out) / "warm-up"  # one untimed save and load: first calls (imports, DCP set-up) out of the figures
    save_sharded_checkpoint(warm, engine, [optimizer], {})
    load_sharded_checkpoint(warm, engine, [optimizer])
    dist.barrier()
    if rank == 0:
        shutil.rmtree(warm)
    times: dict[str, list] = {"on": [], "off": []}
    for run in range(args.runs):
        for checksums in (True, False) if run % 2 == 0 else (False, True):  # alternate which goes first
            path = Path(out) / f"ckpt{run}"
            os.sync()  # the disk starts each save with nothing of an earlier one left to flush
            dist.barrier()
            start = time.perf_counter()
            save_sharded_checkpoint(path, engine, [optimizer], {}, checksums=checksums)
            saved = time.perf_counter() - start
            if rank == 0:
                evict(files_under(path))
            dist.barrier()
            resident = reset_peak_rss()
            start = time.perf_counter()
            load_sharded_checkpoint(path, engine, [optimizer], verify=checksums)
            dist.barrier()
            loaded = time.perf_counter() - start
            growth = max(0, peak_rss() - resident) if resident is not None else None
            nbytes = sum(p.stat().st_size for p in files_under(path))
            times["on" if checksums else "off"].append((saved, loaded, nbytes, growth))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        Path(out, "save_load.json").write_text(json.dumps({"times": times, "params": params}))
    dist.destroy_process_group()


def reset_peak_rss() -> "int | None":
    """Reset this process's peak resident memory (VmHWM) to its current one and return that (None where
    Linux's ``clear_refs`` is not available)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return peak_rss()
    except OSError:
        return None


def peak_rss() -> int:
    return int(Path("/proc/self/status").read_text().split("VmHWM:")[1].split()[0]) * 1024


# -- 3. a 1B-parameter checkpoint, written without training, then consolidated -----------------------------


def big_shapes(args: argparse.Namespace) -> dict[str, tuple[int, ...]]:
    d, shapes = args.big_embd, {"wte.weight": (args.big_vocab, args.big_embd)}
    for i in range(args.big_layers):
        b = f"blocks.{i}."
        shapes.update({b + "ln1.weight": (d,), b + "attn.qkv.weight": (3 * d, d), b + "attn.proj.weight": (d, d),
                       b + "ln2.weight": (d,), b + "mlp.fc.weight": (4 * d, d), b + "mlp.proj.weight": (d, 4 * d)})  # fmt: skip
    shapes["ln_f.weight"] = (d,)
    return shapes


def _generate_worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    from lightning_zero3.checkpoint import FlatPiece, write_sharded_checkpoint
    from lightning_zero3.engine import Communicator

    _init(rank, world, port)
    state = {}
    for name, shape in big_shapes(args).items():
        numel = 1
        for n in shape:
            numel *= n
        per = -(-numel // world)
        start, stop = min(rank * per, numel), min((rank + 1) * per, numel)
        piece = torch.full((stop - start,), float(len(name) % 7 + rank), dtype=torch.float32)
        state[name] = FlatPiece(piece, start, numel, shape)
    seconds = {}
    # the same pieces written with checksums ("big") and without ("big_plain"), the first of them alternating
    # over the runs, each starting once the other's bytes are on the disk
    for checksums in (True, False) if getattr(args, "checked_first", True) else (False, True):
        os.sync()
        dist.barrier()
        start = time.perf_counter()
        write_sharded_checkpoint(Path(out) / ("big" if checksums else "big_plain"), Communicator(), state, [], {},
                                 checksums=checksums)  # fmt: skip
        seconds["on" if checksums else "off"] = time.perf_counter() - start
    if rank == 0:
        Path(out, "big_save.json").write_text(json.dumps(seconds))
    dist.destroy_process_group()


_CONSOLIDATE = """
import sys, time, json
from lightning_zero3.checkpoint.consolidate import consolidate_checkpoint
def hwm(): return int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0]) * 1024
base = hwm(); start = time.perf_counter()
consolidate_checkpoint(sys.argv[1], sys.argv[2], verify=sys.argv[3] == "verify")
print(json.dumps({"baseline": base, "peak": hwm(), "seconds": time.perf_counter() - start}))
"""


def _consolidate(checkpoint: Path, out: Path, verify: bool) -> dict:
    evict(files_under(checkpoint))  # read from the disk, as a checkpoint of an earlier day would be
    done = subprocess.run([sys.executable, "-c", _CONSOLIDATE, str(checkpoint), str(out), "verify" if verify else "no"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def consolidation(args: argparse.Namespace, scratch: Path) -> dict:
    """The 1B checkpoint written with and without checksums (the save), then consolidated from a cold page
    cache with and without checking them (the load), alternating; medians of ``--big-runs``."""
    saves: dict[str, list] = {"on": [], "off": []}
    loads: dict[str, list] = {"on": [], "off": []}
    out = scratch / "big.pt"
    for run in range(args.big_runs):
        args.checked_first = run % 2 == 0
        spawn(_generate_worker, args, str(scratch))
        for key, seconds in json.loads((scratch / "big_save.json").read_text()).items():
            saves[key].append(seconds)
        for verify in (True, False) if run % 2 == 0 else (False, True):
            figures = _consolidate(scratch / ("big" if verify else "big_plain"), out, verify)
            loads["on" if verify else "off"].append(figures)
        shapes = big_shapes(args)
        loaded = torch.load(out, weights_only=True, mmap=True)
        assert loaded.keys() == shapes.keys() and all(tuple(loaded[k].shape) == s for k, s in shapes.items())
        out_bytes = out.stat().st_size
        del loaded
        for name in ("big", "big_plain"):
            shutil.rmtree(scratch / name)
        out.unlink()
    sizes = [4 * torch.Size(s).numel() for s in big_shapes(args).values()]
    figures = min(loads["on"], key=lambda f: f["seconds"])  # memory figures of a checked consolidation
    figures = {**figures, "seconds": statistics.median(f["seconds"] for f in loads["on"]),
               "seconds_unchecked": statistics.median(f["seconds"] for f in loads["off"]),
               "save_s": statistics.median(saves["on"]), "save_s_unchecked": statistics.median(saves["off"]),
               "spreads": {"save": [spread(saves["on"]), spread(saves["off"])],
                           "consolidate": [spread([f["seconds"] for f in loads[k]]) for k in ("on", "off")]}}  # fmt: skip
    figures.update(params=sum(sizes) // 4, model_bytes=sum(sizes), largest=max(sizes), out_bytes=out_bytes)
    return figures


# -- driver ----------------------------------------------------------------------------------------


def spread(values) -> list[float]:
    """min, median, max of the runs' figures."""
    return [min(values), statistics.median(values), max(values)]


def spawn(fn, args: argparse.Namespace, out: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(fn, args=(args.devices, port, args, out), nprocs=args.devices, join=True)


def main(args: argparse.Namespace) -> dict:
    base = args.dir or Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="zero3-ckpt-bench-", dir=base))
    try:
        disks = [disk_bandwidth(scratch, int(args.disk_gb * (1 << 30))) for _ in range(args.runs)]
        write_bw = statistics.median(w for w, _ in disks)
        read_bw = statistics.median(r for _, r in disks)
        spawn(_save_load_worker, args, str(scratch))
        result = json.loads((scratch / "save_load.json").read_text())
        on, off = result["times"]["on"], result["times"]["off"]
        save_s, load_s = statistics.median(t[0] for t in on), statistics.median(t[1] for t in on)
        nbytes = on[0][2]
        figures = {
            "disk_write_gbs": write_bw / 1e9, "disk_read_gbs": read_bw / 1e9,
            "params": result["params"], "checkpoint_bytes": nbytes,
            "save_s": save_s, "load_s": load_s,
            "save_gbs": nbytes / save_s / 1e9, "load_gbs": nbytes / load_s / 1e9,
            "save_s_unchecked": statistics.median(t[0] for t in off),
            "load_s_unchecked": statistics.median(t[1] for t in off),
            "spreads": {"save": [spread([t[0] for t in on]), spread([t[0] for t in off])],
                        "load": [spread([t[1] for t in on]), spread([t[1] for t in off])]},
        }  # fmt: skip
        if on[0][3] is not None:  # the growth of the peak resident memory of a rank during the load
            figures["load_rss_growth"] = statistics.median(t[3] for t in on)
            figures["load_rss_growth_unchecked"] = statistics.median(t[3] for t in off)
        if not args.skip_consolidation:
            figures["consolidation"] = consolidation(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print_table(figures, args)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return figures


def print_table(f: dict, args: argparse.Namespace) -> None:
    from host_facts import describe_host, host_facts

    gb = 1e9
    print("\n" + describe_host(host_facts()))
    print(f"\nSharded checkpoint, {args.devices} ranks, GPT of {f['params'] / 1e6:.1f}M parameters "
          f"({f['checkpoint_bytes'] / gb:.2f} GB with AdamW state), median of {args.runs} runs")  # fmt: skip
    print(f"{'':<8}{'checkpoint GB/s':>17}{'disk GB/s':>11}{'ratio':>8}{'seconds':>9}")
    print(f"{'save':<8}{f['save_gbs']:>17.2f}{f['disk_write_gbs']:>11.2f}{f['save_gbs'] / f['disk_write_gbs']:>8.2f}"
          f"{f['save_s']:>9.2f}")  # fmt: skip
    print(f"{'load':<8}{f['load_gbs']:>17.2f}{f['disk_read_gbs']:>11.2f}{f['load_gbs'] / f['disk_read_gbs']:>8.2f}"
          f"{f['load_s']:>9.2f}")  # fmt: skip
    print(f"\nChecksums (xxh3_64 of every file as it is written, checked before a load), same run")
    print(f"{'':<28}{'with':>9}{'without':>9}{'ratio':>8}   spread with / without: min-median-max s")
    rows = [("save", f["save_s"], f["save_s_unchecked"], f["spreads"]["save"]),
            ("load", f["load_s"], f["load_s_unchecked"], f["spreads"]["load"])]  # fmt: skip
    c = f.get("consolidation")
    if c:
        rows += [(f"save, {c['params'] / 1e9:.2f}B weights", c["save_s"], c["save_s_unchecked"], c["spreads"]["save"]),
                 (f"consolidate, {c['params'] / 1e9:.2f}B (cold)", c["seconds"], c["seconds_unchecked"],
                  c["spreads"]["consolidate"])]  # fmt: skip
    for name, with_s, without_s, (on, off) in rows:
        ranges = " / ".join("-".join(f"{s:.2f}" for s in arm) for arm in (on, off))
        print(f"{name:<28}{with_s:>9.2f}{without_s:>9.2f}{with_s / without_s:>8.3f}   {ranges}")
    if "load_rss_growth" in f:
        mib = 1 << 20
        print(f"{'load: peak RSS growth, MiB':<28}{f['load_rss_growth'] / mib:>9.0f}{f['load_rss_growth_unchecked'] / mib:>9.0f}"
              f"   (per rank; the rank's files: {f['checkpoint_bytes'] / args.devices / mib:.0f} MiB)")  # fmt: skip
    if c:
        mib = 1 << 20
        print(f"\nConsolidation of {c['params'] / 1e9:.2f}B parameters ({c['model_bytes'] / gb:.2f} GB) to one .pt file "
              f"in {c['seconds']:.1f} s ({c['out_bytes'] / c['seconds'] / gb:.2f} GB/s written)")  # fmt: skip
        print(f"  peak RSS {c['peak'] / mib:.0f} MiB = baseline {c['baseline'] / mib:.0f} MiB + "
              f"{(c['peak'] - c['baseline']) / mib:.0f} MiB; largest tensor {c['largest'] / mib:.0f} MiB "
              f"(growth = {(c['peak'] - c['baseline']) / c['largest']:.2f}x the largest tensor, "
              f"{(c['peak'] - c['baseline']) / c['model_bytes']:.3f}x the model)")  # fmt: skip


if __name__ == "__main__":
    main(parse_args())
