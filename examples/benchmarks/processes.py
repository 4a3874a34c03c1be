"""Small helpers the benchmark scripts share: a free port, a process's whole-run peak memory, closing the
process group a worker's strategy left open, the interpreter that runs DeepSpeed's rows, running a worker
(alone, or its ranks under torchrun) and reading what it wrote.

Question: none of its own; it serves the benchmark scripts.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss() -> int:
    """This process's peak resident memory so far, in bytes (the kernel's ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def close_process_group() -> None:
    """Close torch.distributed's process groups as zero3 does at exit (``lightning_zero3.close_process_groups``),
    for every row alike: left open to the interpreter's exit (DDP, FSDP2 under Lightning), or destroyed
    while a handle on them lives on (zero3's engine driven by hand, a DDP module), gloo ends about one
    process in three, or 1 in 40, with SIGABRT ("terminate called without an active exception") after the
    work is done, and the run would count as failed: see [Note: process groups closed at exit] in
    ``lightning_zero3/engine/failure/process_exit.py``.

    The ranks meet in a barrier first, so none leaves before rank 0 has written the result: under
    torchrun a peer rank that aborts at its exit (FSDP2's rank 1 in 2 of 13 quick load runs) makes
    torchrun stop rank 0, which lost the row when it had not written the result yet."""
    import torch.distributed as dist

    from lightning_zero3 import close_process_groups

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    close_process_groups()


PEER_PYTHON_VARIABLE = "ZERO3_PEER_PYTHON"


def add_peer_python_argument(parser: argparse.ArgumentParser) -> None:
    """``--peer-python``: the interpreter that runs the DeepSpeed rows.

    Note: DeepSpeed in an environment of its own. DeepSpeed and what it installs with it change the
    environment that runs zero3 and the tests. Kept in a second virtual environment (the same torch wheel,
    then ``DS_BUILD_OPS=0 pip install deepspeed accelerate transformers safetensors`` and ``pip install -e`` of this
    project), only the DeepSpeed rows run in it; every other row runs in the interpreter that started
    the benchmark."""
    parser.add_argument("--peer-python", default=os.environ.get(PEER_PYTHON_VARIABLE, sys.executable),
                        help=f"the Python interpreter that runs the DeepSpeed rows, e.g. a virtual environment's "
                             f"bin/python with deepspeed installed (default: ${PEER_PYTHON_VARIABLE}, else this "
                             f"interpreter)")  # fmt: skip


def deepspeed_missing(python: str) -> str:
    """Why the DeepSpeed rows cannot run under ``python`` ("" when they can)."""
    if package_version(python, "deepspeed"):
        return ""
    return (f"skipped: DeepSpeed is not installed for {python} (DS_BUILD_OPS=0 pip install deepspeed accelerate, or "
            f"--peer-python naming an interpreter that has it)")


def package_version(python: str, package: str) -> str:
    """``package``'s installed version under ``python`` ("" when it is not installed)."""
    probe = f"import importlib.metadata as m; print(m.version({package!r}))"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120)
    except OSError:  # no such interpreter
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def run_worker(worker: list[str], env: dict, timeout: float, ranks: int = 0, python: str = sys.executable) -> tuple[int, str]:
    """Run ``worker`` (a script and its arguments) with ``python`` in a process of its own, or with
    ``ranks`` under torchrun (DeepSpeed's peer rows' launcher). Returns the exit code and what the worker wrote to
    stderr (else stdout). Under torchrun each rank's stderr goes to a file of its own and is what comes
    back: torchrun's own failure summary names only the signal, and it used to push the ranks' last lines
    out of the tail a failed row shows."""
    if not ranks:
        done = subprocess.run([python, *worker], capture_output=True, text=True, env=env, timeout=timeout)
        return done.returncode, done.stderr or done.stdout
    with tempfile.TemporaryDirectory() as logs:
        cmd = [python, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
               f"--master-port={free_port()}", f"--log-dir={logs}", "--redirects=3", *worker]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        files = sorted(Path(logs).rglob("stderr.log"), key=lambda file: int(file.parent.name))
        said = {file.parent.name: file.read_text()[-700:].strip() for file in files}
    return done.returncode, "\n".join(f"[rank {rank}] {text}" for rank, text in said.items() if text) or done.stderr or done.stdout


def read_result(result: Path, code: int, output: str, exit_may_fail: bool = False) -> dict | str:
    """A worker's result, or why there is none. With ``exit_may_fail`` (DeepSpeed's ranks), a rank that
    dies at its interpreter's exit *after* the result was written (reduced over the ranks) still measured
    what it was run for: that result counts, with the exit kept under ``"exit"`` and shown in the run's
    line. DeepSpeed's CPU ranks did so in 2 of 77 short inference runs ("terminate called without an
    active exception": rank 0's SIGABRT at exit, the process group already closed). zero3's and the other peers'
    workers must exit cleanly: for them a failed exit fails the run."""
    if not result.exists() or (code != 0 and not exit_may_fail):
        return f"failed (exit {code}): {output[-1500:]}"
    outcome = json.loads(result.read_text())
    if code != 0:
        outcome["exit"] = f"exit {code} after its result was written: {output.strip()[-300:]}"
    return outcome


def exit_note(outcome: dict) -> str:
    """What a run's line adds for a result that ``read_result`` kept despite a failed exit ("" if none)."""
    return f" ({outcome['exit']})" if "exit" in outcome else ""
