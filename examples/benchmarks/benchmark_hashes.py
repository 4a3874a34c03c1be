"""Throughput of the checksums a checkpoint could carry, on this machine.

Question: Which checksum keeps up with a checkpoint's save and load (xxh3_64, xxh3_128, crc32c, zlib.crc32)?

    python examples/benchmarks/benchmark_hashes.py                 # 1 GB buffer, best of 3
    python examples/benchmarks/benchmark_hashes.py --gb 4 --runs 5

One thread hashes a buffer of ``--gb`` GB of random bytes in 8 MiB pieces (the pieces checkpoint files are
hashed in while they are written or read), best of ``--runs``. ``crc32c`` is the PyPI package of that name
(hardware CRC32C instructions where the CPU has them); it is measured only where it is installed, as
zero3 does not depend on it. ``sha256`` (what Hugging Face exports record) is given for scale.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
import zlib
from typing import Callable, Optional

PIECE = 8 << 20


def candidates() -> dict[str, Optional[Callable[[memoryview], object]]]:
    """Name -> a function hashing a whole buffer piece by piece (None where its package is missing)."""

    def running(make):
        def run(view: memoryview) -> object:
            digest = make()
            for start in range(0, len(view), PIECE):
                digest.update(view[start : start + PIECE])
            return digest.digest()

        return run

    def folding(update):
        def run(view: memoryview) -> object:
            value = 0
            for start in range(0, len(view), PIECE):
                value = update(view[start : start + PIECE], value)
            return value

        return run

    found: dict[str, Optional[Callable[[memoryview], object]]] = {}
    try:
        import xxhash

        found["xxh3_64"], found["xxh3_128"] = running(xxhash.xxh3_64), running(xxhash.xxh3_128)
    except ImportError:
        found["xxh3_64"] = found["xxh3_128"] = None
    try:
        import crc32c

        found["crc32c"] = folding(crc32c.crc32c)
    except ImportError:
        found["crc32c"] = None
    found["zlib.crc32"] = folding(zlib.crc32)
    found["sha256"] = running(hashlib.sha256)
    return found


def measure(gb: float, runs: int) -> dict[str, Optional[float]]:
    """GB/s of each candidate over one buffer of ``gb`` GB, best of ``runs`` (None: not installed)."""
    data = bytearray(os.urandom(1 << 20)) * max(1, int(gb * 1e9) >> 20)
    view = memoryview(data)
    speeds: dict[str, Optional[float]] = {}
    for name, run in candidates().items():
        if run is None:
            speeds[name] = None
            continue
        best = float("inf")
        for _ in range(runs):
            start = time.perf_counter()
            run(view)
            best = min(best, time.perf_counter() - start)
        speeds[name] = len(data) / best / 1e9
    return speeds


def main(argv=None) -> dict[str, Optional[float]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0, help="size of the buffer hashed, in GB")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    speeds = measure(args.gb, args.runs)
    from host_facts import describe_host, host_facts

    print(describe_host(host_facts()))
    print(f"{'checksum':<12}{'GB/s':>8}   (one thread, {args.gb:g} GB buffer, best of {args.runs})")
    for name, speed in speeds.items():
        print(f"{name:<12}{'not installed' if speed is None else f'{speed:8.2f}':>8}")
    return speeds


if __name__ == "__main__":
    main()
