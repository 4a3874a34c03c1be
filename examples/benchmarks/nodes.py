"""Simulated nodes for ``benchmark.py --nodes N``: start a run as N torchrun agents on this host, and count
what every strategy moves across node boundaries.

Question: How many bytes does each strategy move across (simulated) node boundaries?

``run_as_nodes`` starts one ``torchrun --nnodes N --nproc-per-node G`` agent per simulated node, all
meeting at a c10d rendezvous on 127.0.0.1 (public tools only; on a cluster each agent runs on its own
machine with the same command). Lightning picks ``TorchElasticEnvironment`` and numbers the ranks node by
node, so rank r is on node r // G.

``CrossNodeCounter`` counts, inside a rank, every collective that ``torch.distributed`` is asked for
(``all_reduce``, ``all_gather_single`` / ``all_gather_into_tensor`` / ``all_gather``, ``reduce_scatter_single``
/ ``reduce_scatter_tensor``, ``broadcast``), with the rule zero3's byte ledger uses: the bytes this rank
receives from ranks on other nodes ([Note: inter-node bytes] in ``lightning_zero3/engine/comm/topology.py``).
DDP (through a Python communication hook that all-reduces like its built-in one), torch FSDP2 (its
collectives are Python calls) and zero3 all go through those functions, so every strategy is counted the
same way, and zero3's count can be checked against its own ledger.
"""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Optional, Sequence

import torch.distributed as dist
from processes import free_port

from lightning_zero3.engine.comm.topology import Topology, inter_node_bytes


def run_as_nodes(script_args: Sequence[str], nodes: int, per_node: int, env: dict, timeout: float) -> tuple[int, str]:
    """Run ``python script_args`` as ``nodes`` torchrun agents of ``per_node`` ranks each; returns (exit code,
    the tail of the output). A failing agent, or the deadline, ends the others."""
    endpoint, run_id = f"127.0.0.1:{free_port()}", f"bench-{os.getpid()}-{time.monotonic_ns()}"
    agents = []
    for node in range(nodes):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", str(per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
            "--rdzv-conf", f"is_host={int(node == 0)}",  # both agents run on the endpoint's host: say which hosts it
            "--max-restarts", "0", *script_args,
        ]  # fmt: skip
        agents.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline, code = time.monotonic() + timeout, 0
    while any(agent.poll() is None for agent in agents):
        failed = [agent.returncode for agent in agents if agent.returncode not in (None, 0)]
        if failed or time.monotonic() > deadline:
            code = failed[0] if failed else 124
            for agent in agents:
                if agent.poll() is None:
                    agent.send_signal(signal.SIGTERM)  # torchrun passes it on to its ranks
            break
        time.sleep(0.2)
    outputs = [agent.communicate(timeout=60)[0] for agent in agents]
    code = code or next((agent.returncode for agent in agents if agent.returncode), 0)
    return code, "\n".join(out[-1500:] for out in outputs)


class CrossNodeCounter:
    """Bytes this rank received from other nodes in the collectives ``torch.distributed`` ran, while ``counting``."""

    # function -> (collective kind for the rule, the argument that holds the full buffer)
    WRAPPED = {
        "all_reduce": ("all_reduce", "tensor"),
        "all_gather_single": ("all_gather", "output_tensor"),
        "all_gather_into_tensor": ("all_gather", "output_tensor"),
        "all_gather": ("all_gather", "tensor_list"),
        "reduce_scatter_single": ("reduce_scatter", "input"),
        "reduce_scatter_tensor": ("reduce_scatter", "input"),
        "broadcast": ("broadcast", "tensor"),
    }

    def __init__(self, ranks_per_node: int) -> None:
        self.topology = Topology(ranks_per_node)
        self.bytes = 0
        self.counting = False  # the caller turns it on for the steps it measures
        self._originals: dict[str, Callable] = {}
        self._members: dict[int, list[int]] = {}

    def install(self) -> "CrossNodeCounter":
        for name, (kind, buffer) in self.WRAPPED.items():
            original = getattr(dist, name)
            self._originals[name] = original
            setattr(dist, name, self._wrap(original, kind, buffer))
        return self

    def _wrap(self, original: Callable, kind: str, buffer: str) -> Callable:
        signature = inspect.signature(original)

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.counting:
                bound = signature.bind(*args, **kwargs)
                self.bytes += self._received(kind, bound.arguments[buffer], bound.arguments)
            return original(*args, **kwargs)

        return counted

    def _received(self, kind: str, full: Any, arguments: dict) -> int:
        nbytes = sum(t.numel() * t.element_size() for t in full) if isinstance(full, list) else full.numel() * full.element_size()
        members = self._group_members(arguments.get("group"))
        me = dist.get_rank()
        if kind == "broadcast":
            source = arguments.get("src")
            if source is None:  # given as a rank of the group
                source = members[arguments.get("group_src") or 0]
            return nbytes if self.topology.node_of(source) != self.topology.node_of(me) else 0
        return inter_node_bytes(kind, nbytes, len(members), self.topology.remote_members(members, me))

    def _group_members(self, group: Optional[Any]) -> list[int]:
        key = id(group)
        if key not in self._members:
            world = group is None or group is dist.GroupMember.WORLD
            self._members[key] = list(range(dist.get_world_size())) if world else dist.get_process_group_ranks(group)
        return self._members[key]

