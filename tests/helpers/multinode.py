"""Run a script as several simulated nodes on this host, the way a cluster launcher would start it.

``torchrun_nodes`` starts one ``torchrun`` per node, all joining one c10d rendezvous on 127.0.0.1 (each
agent then starts ``per_node`` ranks and sets RANK / LOCAL_RANK / GROUP_RANK / WORLD_SIZE / MASTER_*),
so Lightning picks ``TorchElasticEnvironment``. ``slurm_nodes`` starts every task itself with the
variables ``srun`` gives a task (SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, SLURM_NTASKS, ...), so
Lightning picks ``SLURMEnvironment``; like a real job it sets no MASTER_ADDR / MASTER_PORT: Lightning
derives them from SLURM_NODELIST and SLURM_JOB_ID.

Every process of a launch runs with ``MULTINODE_LAUNCH=<node index>`` in its environment. A launch
that fails or outlives ``timeout`` ends every process it started, the ranks torchrun started included.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from distributed import free_port

# Ports Lightning's SLURMEnvironment derives from a job id: 15000 + the id's last four digits.
_SLURM_PORTS = range(15000, 25000)


@dataclass
class _Process:
    name: str
    popen: subprocess.Popen
    log: Path


def torchrun_nodes(
    script: Path, args: Sequence[str], nodes: int = 2, per_node: int = 2, timeout: float = 300, env: dict | None = None
) -> None:
    """``torchrun --nnodes nodes --nproc-per-node per_node script args`` once per simulated node."""
    endpoint = f"127.0.0.1:{free_port()}"
    run_id = f"multinode-{os.getpid()}-{time.monotonic_ns()}"
    commands = []
    for node in range(nodes):
        command = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(nodes), "--nproc-per-node", str(per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
            # the first agent hosts the rendezvous store: set here, because both agents run on the host
            # the endpoint names (on a real cluster torchrun works this out itself)
            "--rdzv-conf", f"is_host={int(node == 0)}",
            "--max-restarts", "0",
            str(script), *args,
        ]  # fmt: skip
        commands.append((f"node{node}", command, {**os.environ, **(env or {}), "MULTINODE_LAUNCH": str(node)}))
    run_together(commands, timeout)


def slurm_task_env(node: int, local: int, nodes: int, per_node: int, job_id: str) -> dict[str, str]:
    """The variables ``srun`` sets for one task of a ``--nodes=nodes --ntasks-per-node=per_node`` job that
    Lightning reads (see ``lightning.fabric.plugins.environments.slurm``)."""
    return {
        "SLURM_JOB_ID": job_id,
        "SLURM_JOB_NAME": "multinode-test",  # not "bash" / "interactive", which Lightning treats as no SLURM
        "SLURM_NNODES": str(nodes),
        "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_NODELIST": ",".join(["127.0.0.1"] * nodes),  # the first entry is the main address
        "SLURM_JOB_NODELIST": ",".join(["127.0.0.1"] * nodes),
        "SLURM_NTASKS": str(nodes * per_node),
        "SLURM_NTASKS_PER_NODE": str(per_node),
        "SLURM_TASKS_PER_NODE": f"{per_node}(x{nodes})",
        "SLURM_NODEID": str(node),
        "SLURM_LOCALID": str(local),
        "SLURM_PROCID": str(node * per_node + local),
    }


def slurm_nodes(
    script: Path, args: Sequence[str], nodes: int = 2, per_node: int = 2, timeout: float = 300, env: dict | None = None
) -> None:
    """``srun python script args`` in a ``--nodes=nodes --ntasks-per-node=per_node`` job, simulated."""
    port = _free_port_in(_SLURM_PORTS)
    job_id = f"7{port - 15000:04d}"  # Lightning's main port for this job id is `port`
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_ADDR", "MASTER_PORT"))}
    commands = []
    for node in range(nodes):
        for local in range(per_node):
            task = {**clean, **(env or {}), **slurm_task_env(node, local, nodes, per_node, job_id)}
            task["MULTINODE_LAUNCH"] = str(node)
            commands.append((f"task{node * per_node + local}", [sys.executable, str(script), *args], task))
    run_together(commands, timeout)


def _free_port_in(ports: range) -> int:
    start = (os.getpid() * 7919) % len(ports)  # apart from other test runs' choices
    for port in [*ports[start:], *ports[:start]]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {ports}")


def run_together(commands: list[tuple[str, list[str], dict]], timeout: float) -> None:
    """Start every ``(name, command, environment)`` at once and wait for all. The first process that fails (or the
    deadline) ends them all; raises ``AssertionError`` with the tail of each process's output."""
    with tempfile.TemporaryDirectory() as logs:
        processes: list[_Process] = []
        try:
            for name, command, env in commands:
                log = Path(logs) / f"{name}.log"
                with open(log, "w") as sink:
                    popen = subprocess.Popen(
                        command, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
                    )
                processes.append(_Process(name, popen, log))
            failure = _wait_all(processes, time.monotonic() + timeout)
        finally:
            _end_all(processes)
        if failure:
            tails = [f"--- {p.name} (exit {p.popen.returncode}):\n{p.log.read_text()[-4000:]}" for p in processes]
            raise AssertionError("\n".join([failure, *tails]))


def _wait_all(processes: list[_Process], deadline: float) -> str | None:
    while True:
        codes = [p.popen.poll() for p in processes]
        if any(code not in (None, 0) for code in codes):
            failed = [p.name for p, code in zip(processes, codes) if code not in (None, 0)]
            return f"{', '.join(failed)} failed"
        if all(code == 0 for code in codes):
            return None
        if time.monotonic() > deadline:
            return "the launch did not finish in time"
        time.sleep(0.2)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux ``/proc``): torchrun starts its ranks in sessions of their own."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _end_all(processes: list[_Process]) -> None:
    """SIGTERM every process still running (torchrun passes it on to its ranks), then SIGKILL whatever
    of them, or of the processes they started, is left after a grace period."""
    running = [p.popen for p in processes if p.popen.poll() is None]
    if not running:
        return
    started = [pid for popen in running for pid in (popen.pid, *_descendants(popen.pid))]
    for popen in running:
        popen.send_signal(signal.SIGTERM)
    grace = time.monotonic() + 10
    while time.monotonic() < grace and any(popen.poll() is None for popen in running):
        time.sleep(0.1)
    for pid in started:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for popen in running:
        popen.wait()
