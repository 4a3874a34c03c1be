"""Two nodes of two CPU ranks, simulated on this host and started as a cluster starts them: torchrun
agents joining a c10d rendezvous, and tasks carrying SLURM's variables. One launch per launcher runs
zero3 (with sharded checkpoints), zero3 resumed, and DDP; the tests below read what each rank saw."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoint_files import assert_sharded_layout
from multinode import slurm_nodes, torchrun_nodes

from lightning_zero3.frontends.cpu_threads import CoreSet, ranks_sharing, threads_per_rank

SCRIPT = Path(__file__).parents[1] / "scripts" / "multinode_run.py"
NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
SAMPLES = 24  # multinode_run.py: 3 steps of a global batch of 8
LOSS_RTOL = 1e-5  # as tests/frontends/test_parity.py: another summation order moves losses by a few 1e-7
ENVIRONMENT = {"torchrun": "TorchElasticEnvironment", "slurm": "SLURMEnvironment"}
LAUNCHERS = {"torchrun": torchrun_nodes, "slurm": slurm_nodes}
QUIET = {"PYTHONWARNINGS": "ignore"}


def _read(out: Path, mode: str, world: int) -> list[dict]:
    return [json.loads((out / f"{mode}-rank{rank}.json").read_text()) for rank in range(world)]


@pytest.fixture(scope="module", params=list(LAUNCHERS))
def launched(request, tmp_path_factory) -> tuple[str, list[dict], list[dict]]:
    """(launcher, what every rank of the 2x2 launch recorded, what every rank of a 1x2 resume recorded)."""
    out = tmp_path_factory.mktemp(request.param)
    args = ["train", "--nodes", str(NODES), "--devices", str(PER_NODE), "--out", str(out)]
    LAUNCHERS[request.param](SCRIPT, args, nodes=NODES, per_node=PER_NODE, timeout=300, env=QUIET)
    single = out / "single-node"
    single.mkdir()
    done = subprocess.run(  # one node of 2 ranks, Lightning's own launcher, from the 2x2 checkpoint
        [sys.executable, str(SCRIPT), "resume", "--nodes", "1", "--devices", str(PER_NODE), "--out", str(single),
         "--ckpt", str(out / "ckpt" / "step=3.ckpt")],
        capture_output=True, text=True, timeout=300, env={**_without_launcher_variables(), **QUIET},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return request.param, _read(out, "train", WORLD), _read(single, "resume", PER_NODE)


def _without_launcher_variables() -> dict[str, str]:
    launcher = ("SLURM_", "TORCHELASTIC_", "MASTER_", "RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "NODE_RANK")
    return {k: v for k, v in os.environ.items() if not k.startswith(launcher)}


def test_ranks_and_nodes_come_from_the_cluster_environment(launched):
    launcher, ranks, _ = launched
    for rank, r in enumerate(ranks):
        for who in (r["identity"], r["ddp_identity"]):
            assert who["cluster_environment"] == ENVIRONMENT[launcher]
            assert (who["global_rank"], who["dist_rank"], who["rank_zero_only"]) == (rank, rank, rank)
            assert who["world_size"] == who["dist_world_size"] == WORLD and who["num_nodes"] == NODES
            assert who["global_rank"] == who["node_rank"] * PER_NODE + who["local_rank"]
            assert who["is_global_zero"] == (rank == 0)
    nodes: dict[str, set] = {}  # the two ranks one launch (one simulated node) started share a node rank
    for r in ranks:
        nodes.setdefault(r["identity"]["launch"], set()).add((r["identity"]["node_rank"], r["identity"]["local_rank"]))
    assert sorted(sorted(members) for members in nodes.values()) == [[(n, 0), (n, 1)] for n in range(NODES)]


def test_each_rank_trains_on_its_own_part_of_the_data(launched):
    _, ranks, _ = launched
    for epoch in range(2):
        seen = [set(r["seen"][epoch]) for r in ranks]
        assert all(len(s) == SAMPLES // WORLD for s in seen)
        assert set().union(*seen) == set(range(SAMPLES))  # disjoint parts that cover the data
    assert all(r["identity"]["sampler"] == "DistributedSampler" for r in ranks)


def test_losses_equal_ddp_on_the_same_layout(launched):
    _, ranks, _ = launched
    zero3, ddp = ranks[0]["zero3"], ranks[0]["ddp"]
    assert len(zero3) == len(ddp) == 6 and zero3[-1] < zero3[0]
    for step, (a, b) in enumerate(zip(zero3, ddp)):
        assert abs(a - b) <= LOSS_RTOL * abs(b), f"step {step}: zero3 {a} vs ddp {b}"
    assert all(r["zero3"] == zero3 and r["ddp"] == ddp for r in ranks)  # the mean over ranks, everywhere


def test_a_sharded_checkpoint_saved_on_two_nodes_resumes_exactly_on_two_nodes(launched):
    _, ranks, _ = launched
    assert sorted(ranks[0]["checkpoints"]) == ["step=3.ckpt", "step=6.ckpt"]
    for names in ranks[0]["checkpoints"].values():
        assert_sharded_layout(names, WORLD)  # every rank wrote its own shards
    for r in ranks:
        assert r["resumed"] == r["zero3"][3:]  # bitwise: weights, Adam state and loop state restored


def test_a_checkpoint_saved_on_two_nodes_resumes_on_one(launched):
    """Same global batch per step (2 ranks x 4 samples instead of 4 x 2), so the same losses; the shards
    are re-cut for 2 ranks and the per-rank means are summed in another order."""
    _, ranks, single = launched
    for r in single:
        assert r["identity"]["cluster_environment"] == "LightningEnvironment"
        assert r["identity"]["world_size"] == PER_NODE and r["identity"]["num_nodes"] == 1
        assert len(r["resumed"]) == 3
        for step, (a, b) in enumerate(zip(r["resumed"], ranks[0]["zero3"][3:])):
            assert abs(a - b) <= LOSS_RTOL * abs(b), f"step {3 + step}: 1x2 {a} vs 2x2 {b}"
    assert set(single[0]["seen"][0]).isdisjoint(single[1]["seen"][0])


def test_the_thread_budget_counts_every_rank_on_this_host(launched):
    """Four ranks on this host's cores, whatever node the launcher says each is on."""
    _, ranks, single = launched
    cores = len(os.sched_getaffinity(0))
    for r in ranks:
        assert r["identity"]["ranks_sharing_cores"] == WORLD
        assert r["identity"]["threads"] == max(1, cores // WORLD)
    for r in single:
        assert r["identity"]["ranks_sharing_cores"] == PER_NODE
        assert r["identity"]["threads"] == max(1, cores // PER_NODE)


# -- the thread budget, in-process ------------------------------------------------------------------


def _ranks(*layout: tuple[str, range]) -> list[CoreSet]:
    return [CoreSet(machine, frozenset(cores)) for machine, cores in layout]


def test_threads_are_the_cores_shared_by_every_rank_of_the_machine():
    two_nodes_on_one_host = _ranks(*[("host", range(16))] * 4)  # 2 simulated nodes x 2 ranks, 16 cores
    mine = two_nodes_on_one_host[0]
    assert ranks_sharing(mine, two_nodes_on_one_host) == 4
    assert threads_per_rank(mine, 4) == 4  # not 16 // 2 per launched node: that would run 32 threads
    small = _ranks(*[("host", range(2))] * 4)  # this machine: 2 cores, 4 ranks
    assert threads_per_rank(small[0], ranks_sharing(small[0], small)) == 1  # never 0


def test_ranks_on_other_machines_or_other_cores_do_not_count():
    two_hosts = _ranks(("a", range(16)), ("a", range(16)), ("b", range(16)), ("b", range(16)))
    assert ranks_sharing(two_hosts[2], two_hosts) == 2 and threads_per_rank(two_hosts[2], 2) == 8
    pinned = _ranks(("a", range(0, 4)), ("a", range(4, 8)), ("a", range(8, 12)), ("a", range(12, 16)))
    assert ranks_sharing(pinned[1], pinned) == 1 and threads_per_rank(pinned[1], 1) == 4  # a scheduler's --cpu-bind


# -- the launch helper leaves nothing behind ---------------------------------------------------------

_ONE_RANK_FAILS = """
import os, sys, time, pathlib
out = pathlib.Path(sys.argv[1])
rank = os.environ.get("RANK") or os.environ["SLURM_PROCID"]
(out / f"{os.getpid()}.pid").write_text(rank)
if rank == "3":  # fails once every rank runs; the others would wait for it forever
    deadline = time.monotonic() + 120
    while len(list(out.glob("*.pid"))) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(3)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_a_failed_launch_ends_every_process_it_started(tmp_path, launcher):
    script = tmp_path / "one_rank_fails.py"
    script.write_text(_ONE_RANK_FAILS)
    with pytest.raises(AssertionError, match="failed") as failure:
        LAUNCHERS[launcher](script, [str(tmp_path)], nodes=NODES, per_node=PER_NODE, timeout=120)
    pids = [int(p.stem) for p in tmp_path.glob("*.pid")]
    assert len(pids) == WORLD, str(failure.value)
    assert not [pid for pid in pids if _running(pid)]
