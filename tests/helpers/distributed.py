"""Run a function on N CPU ranks (gloo) in fresh processes and collect what each rank returns."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_zero3 import close_process_groups


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world_size: int, port: int, out: str, args: tuple, environ: dict) -> None:
    os.environ.clear()  # the caller's environment now, not the server's from when it started
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out) / f"rank{rank}.pt")
        if dist.is_initialized():  # ``fn`` may have closed the groups itself
            dist.barrier()
    finally:
        close_process_groups()  # as zero3 does at exit: see [Note: process groups closed at exit]


# Ranks are forked from a server process that imported these once (``forkserver``): a rank starts in a
# fraction of a second instead of the 5-6 s a fresh interpreter takes to import torch and Lightning. The
# server is started fresh (no threads, no process group), so each rank starts as a clean process would,
# with the caller's environment of the moment (what a module reads at import keeps the server's).
PRELOAD = ["torch", "torch.distributed", "lightning.pytorch", "lightning_zero3"]


def run_ranks(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """``fn(rank, world_size, *args)`` on every rank; returns the list of results in rank order."""
    with tempfile.TemporaryDirectory() as out:
        mp.set_forkserver_preload(PRELOAD)
        mp.start_processes(_entry, args=(fn, world_size, free_port(), out, args, dict(os.environ)), nprocs=world_size, join=True,
                           start_method="forkserver")  # fmt: skip
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def _script_environment() -> dict[str, str]:
    """This process's environment less a rendezvous address: a script's launcher picks its own free port (an
    inherited ``MASTER_PORT`` may be one this process still listens on)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    return {**env, "PYTHONWARNINGS": "ignore"}


def run_script(script: Path, *args: str, timeout: int = 600, fails: bool = False) -> subprocess.CompletedProcess:
    """Run one of ``tests/scripts`` in a fresh interpreter (it launches its own ranks); fail with its output tail
    unless it succeeded (with ``fails``: unless it failed). Returns the finished process."""
    done = subprocess.run(
        [sys.executable, str(script), *map(str, args)],
        capture_output=True, text=True, timeout=timeout, env=_script_environment(),
    )  # fmt: skip
    assert (done.returncode != 0) == fails, done.stdout[-3000:] + done.stderr[-5000:]
    return done
