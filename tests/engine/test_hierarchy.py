"""Beyond one node: secondary shards (hpZ), int8 gathers (qwZ), and the bytes that cross nodes.

Two simulated nodes of two CPU ranks (gloo). The engine-level cases run on four spawned ranks with an
explicit ranks-per-node of 2; one Lightning run starts four ranks as the tasks of a two-node SLURM job,
whose environment has no ``LOCAL_WORLD_SIZE`` (torchrun's), so ``secondary_shard_size="node"`` can only
be resolved from the Trainer's ``devices``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_ranks
from multinode import slurm_nodes
from torch import nn

from lightning_zero3 import Zero3Config, Zero3ConfigError, Zero3Engine
from lightning_zero3.engine.comm.communicator import Communicator
from lightning_zero3.engine.comm.quantize import BLOCK, decode_int8, encode_int8, padded, payload_bytes
from lightning_zero3.engine.comm.topology import Topology, inter_node_bytes
from lightning_zero3.engine.memory.buffers import resident_bytes
from lightning_zero3.engine.shard.secondary import resolve_size

WORLD, PER_NODE = 4, 2
WIDTH, BLOCKS, CLASSES = 256, 4, 4
BASE = dict(persistence_threshold=0, tune_collectives=False, unit_modules=["Block", "Head"])
CASES = {
    "plain": {},
    "hpz": {"secondary_shard_size": "node"},
    "int8": {"quantize_gathers": "int8"},
    "hpz+int8": {"secondary_shard_size": 2, "quantize_gathers": "int8"},
}
# int8 gathers change every weight forward and backward see by up to max|w| / 254 of its block of 256
# (quantize.py). Allowed: 1%, the bound the README's 300-step GPT run is held to; each rank's loss on its
# 8 samples moved by 7e-5 to 1.6e-3 relative over these 5 steps when this test was written.
INT8_LOSS_RTOL = 1e-2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.fc(x))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(BLOCKS)], Head())


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, WIDTH, generator=g), torch.randint(0, CLASSES, (8,), generator=g)


def _totals(comm: Communicator) -> dict[str, tuple[int, int, int]]:
    """(calls, bytes, inter-node bytes) per "group/kind" so far."""
    return {f"{g}/{k}": (s.count, s.bytes, s.inter_node_bytes) for (g, k), s in comm.by_group.items()}


def _delta(after: dict, before: dict) -> dict:
    return {key: tuple(a - b for a, b in zip(value, before.get(key, (0, 0, 0)))) for key, value in after.items()}


class IssuedCollectives:
    """Every collective this rank issues through ``torch.distributed`` while ``on``, as it is issued: the
    call, the group, this rank's input and output bytes. The engine's ledger is not consulted: the test
    derives the bytes that crossed nodes from these records alone (``_counted_inter_node``)."""

    COUNTED = ("all_gather_single", "reduce_scatter_single")
    OTHERS = ("all_gather", "all_reduce", "broadcast", "reduce_scatter", "batch_isend_irecv", "all_to_all_single")

    def __init__(self) -> None:
        self.on, self.records = False, []
        self._saved = {name: getattr(dist, name) for name in self.COUNTED + self.OTHERS}
        for name, real in self._saved.items():
            setattr(dist, name, self._recording(name, real))

    def _recording(self, name, real):
        def recorded(*args, **kwargs):
            if self.on:
                if name in self.COUNTED:
                    output, given = args[0], args[1]  # (output, input, ...) for both
                    group = kwargs.get("group")
                    self.records.append((name, group, output.numel() * output.element_size(),
                                         given.numel() * given.element_size()))  # fmt: skip
                else:  # a kind this test has no counting rule for: make it fail, naming it
                    self.records.append((name, kwargs.get("group"), -1, -1))
            return real(*args, **kwargs)

        return recorded

    def named(self, comm: Communicator) -> list[tuple[str, str, list[int], int, int]]:
        """The records with their group named as the ledger names it, and its members (global ranks)."""
        groups = {id(comm.secondary_group): "secondary", id(comm.check_group): "check",
                  id(comm.reduce_group): "reduce", id(comm.group): "job"}  # fmt: skip
        assert len({id(comm.check_group), id(comm.reduce_group), id(comm.group)}) == 3  # three distinct groups
        named = []
        for op, group, out_bytes, in_bytes in self.records:
            name = groups[id(group)]
            members = comm.group_members(name)
            named.append((op, name, list(members), out_bytes, in_bytes))
        return named

    def close(self) -> None:
        for name, real in self._saved.items():
            setattr(dist, name, real)


def _counted_inter_node(ranks: list[list[tuple]], per_node: int) -> list[dict[str, int]]:
    """Per rank, per "group/kind", the bytes it received from ranks on other nodes, counted from what every
    rank issued: the i-th collective a rank issued on a group is the i-th of every member of that group.
    From each member on another node (rank // per_node differs), a rank receives in an all-gather that
    member's whole input (its shard), in a reduce-scatter the member's contribution to this rank's slice
    (its input / group size)."""
    streams: dict[tuple, dict[int, list]] = {}  # (group name, members) -> rank -> its records there, in order
    for rank, records in enumerate(ranks):
        for record in records:
            op, name, members, _, _ = record
            assert op in IssuedCollectives.COUNTED, f"no counting rule for {op} on {name}: the test counts too little"
            streams.setdefault((name, tuple(members)), {}).setdefault(rank, []).append(record)
    counted: list[dict[str, int]] = [{} for _ in ranks]
    for (name, members), by_rank in streams.items():
        assert set(by_rank) == set(members), (name, members)  # every member issued on its group
        lengths = {len(records) for records in by_rank.values()}
        assert len(lengths) == 1, (name, lengths)  # and as many collectives
        for me in members:
            for index, (op, *_rest) in enumerate(by_rank[me]):
                kind = "check" if name == "check" else op.removesuffix("_single")
                received = 0
                for peer in members:
                    peer_op, _, _, _, peer_in = by_rank[peer][index]
                    assert peer_op == op, (name, index, op, peer_op)
                    if peer != me and peer // per_node != me // per_node:
                        received += peer_in if op == "all_gather_single" else peer_in // len(members)
                key = f"{name}/{kind}"
                counted[me][key] = counted[me].get(key, 0) + received
    return counted


def _train(rank: int, knobs: dict) -> dict:
    model = _model()
    issued = IssuedCollectives()
    engine = Zero3Engine(model, Zero3Config(**BASE, **knobs), Communicator(ranks_per_node=PER_NODE))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine.shard_optimizer(optimizer)

    def step(index: int, dangling_forward: bool = False) -> float:
        loss = F.cross_entropy(model(_batch(rank, index)[0]), _batch(rank, index)[1])
        loss.backward()
        if dangling_forward:  # a forward whose graph is dropped: its secondary shards live on ...
            model(_batch(rank, index + 100)[0])
        optimizer.step()  # ... until the step changes the shards under them
        optimizer.zero_grad()
        return loss.item()

    losses, phases, after_forward, after_backward = [], [], [], []
    for index in range(3):  # clean steps: what each phase moved
        x, y = _batch(rank, index)
        issued.on = index == 2  # a step after the recording one, as the ledger's figures below
        t0 = _totals(engine.comm)
        loss = F.cross_entropy(model(x), y)
        t1 = _totals(engine.comm)
        after_forward.append(_secondary_bytes(engine))
        loss.backward()
        t2 = _totals(engine.comm)
        after_backward.append(_secondary_bytes(engine))
        optimizer.step()
        optimizer.zero_grad()
        t3 = _totals(engine.comm)
        losses.append(loss.item())
        phases.append({"forward": _delta(t1, t0), "backward": _delta(t2, t1), "step": _delta(t3, t2)})
    issued.on = False
    records = issued.named(engine.comm)
    issued.close()
    report = engine.memory_report()
    saved = engine.full_state_dict(), engine.full_optimizer_state(optimizer)
    straight = [step(i, dangling_forward=True) for i in (3, 4)]
    model(_batch(rank, 200)[0])  # secondary shards alive when the checkpoint is loaded under them
    engine.load_full_state_dict(saved[0])
    engine.load_full_optimizer_state(optimizer, saved[1])
    resumed = [step(i, dangling_forward=True) for i in (3, 4)]
    return {
        "losses": losses + straight,
        "resumed": resumed,
        "phases": phases,
        "after_forward": after_forward,
        "after_backward": after_backward,
        "peak_secondary": report["peak_secondary_shards"],
        "unit_bytes": sum(engine.unit_sizes().values()),
        "secondary_size": engine.secondary_size,
        "weights": engine.full_state_dict(),
        "issued": records,  # step 2's collectives, as this rank issued them
    }


def _secondary_bytes(engine: Zero3Engine) -> tuple[int, int]:
    """(ledger, pages really resident) of the secondary shards now."""
    real = sum(resident_bytes(rt.group.secondary.buffer) for rt in engine.runtimes if rt.group.secondary is not None)
    return engine.ledger.held["secondary_shards"], real


def _all_cases(rank: int, world: int) -> dict:
    return {name: _train(rank, knobs) for name, knobs in CASES.items()}


@pytest.fixture(scope="module")
def trained() -> list[dict]:
    return run_ranks(_all_cases, WORLD)


def _step_inter_node(phases: dict, kind: str | None = None, group: str | None = None) -> int:
    return sum(
        inter for phase in phases.values() for key, (_, _, inter) in phase.items()
        if (kind is None or key.endswith("/" + kind)) and (group is None or key.startswith(group + "/"))
    )  # fmt: skip


def test_secondary_shards_train_bitwise_like_plain_zero3_through_a_checkpoint_load(trained):
    for rank in trained:
        plain, hpz = rank["plain"], rank["hpz"]
        assert hpz["secondary_size"] == PER_NODE and plain["secondary_size"] is None
        assert hpz["losses"] == plain["losses"] and hpz["resumed"] == plain["resumed"]
        assert hpz["resumed"] == hpz["losses"][3:]  # the load dropped the secondary shards it made stale
        for name, value in plain["weights"].items():
            assert torch.equal(hpz["weights"][name], value), name
        # int8 gathers: backward from the secondary shards sees exactly the (dequantized) weights forward saw
        assert rank["hpz+int8"]["losses"] == rank["int8"]["losses"]
        assert rank["hpz+int8"]["resumed"] == rank["int8"]["resumed"] == rank["int8"]["losses"][3:]


def test_backward_gathers_stay_inside_the_node(trained):
    for rank in trained:
        for name in ("hpz", "hpz+int8"):
            for phase in rank[name]["phases"]:
                backward = phase["backward"]
                assert "job/all_gather" not in backward or backward["job/all_gather"][0] == 0  # nothing global
                calls, nbytes, inter = backward["secondary/all_gather"]
                assert calls > 0 and nbytes > 0 and inter == 0
        for phase in rank["plain"]["phases"]:
            assert phase["backward"]["job/all_gather"][2] > 0  # without them it crosses nodes


def test_secondary_shards_cut_the_bytes_crossing_nodes_to_two_thirds(trained):
    """ZeRO-3 moves each unit across nodes three times a step (forward gather, backward gather, gradient
    reduce-scatter); hpZ keeps the second inside the node: 2/3. The unit kept gathered from forward into
    backward (here the small head) and the 80-byte identity checks keep the ratio just above 2/3."""
    for rank in trained:
        plain, hpz = rank["plain"]["phases"][2], rank["hpz"]["phases"][2]  # a step after the recording one
        assert _step_inter_node(hpz) <= 0.67 * _step_inter_node(plain)
        assert _step_inter_node(hpz, group="reduce") == _step_inter_node(plain, group="reduce") > 0
        assert hpz["forward"]["job/all_gather"] == plain["forward"]["job/all_gather"]


def test_bytes_counted_from_the_issued_collectives_are_the_ledgers_and_the_paper_formulas(trained):
    """The bytes that crossed nodes in step 2, counted from the collectives every rank issued (payload
    sizes per process group and its members, ``_counted_inter_node``), not from ``inter_node_bytes``:
    the ledger's figures (which that rule computes) are these, group by group, to the byte; and the
    README's 8x8 / 70B table (``examples/benchmarks/bytes_across_nodes.py``, the same rule applied to the whole model
    on paper) is within 2% of them here. The formula counts every parameter in every collective: here the
    head kept gathered from forward into backward (0.4% of the parameters), padding and the identity
    checks make the counted figures differ by well under 2%."""
    from bytes_across_nodes import per_rank

    paper = per_rank(trained[0]["plain"]["unit_bytes"] // 4, nodes=WORLD // PER_NODE, ranks_per_node=PER_NODE, nbytes=4)
    names = {"plain": "FSDP / zero3", "hpz": "zero3 + hpZ", "int8": "zero3 + int8", "hpz+int8": "zero3 + hpZ + int8"}
    for case, row in names.items():
        counted = _counted_inter_node([rank[case]["issued"] for rank in trained], PER_NODE)
        for rank, mine in zip(trained, counted):
            ledger = {}
            for phase in rank[case]["phases"][2].values():
                for key, (calls, _, inter) in phase.items():
                    if calls:
                        ledger[key] = ledger.get(key, 0) + inter
            assert mine == ledger, (case, mine, ledger)
            assert sum(mine.values()) > 0
            assert abs(sum(mine.values()) - paper[row]) <= 0.02 * paper[row], (case, mine, paper[row])
        if "hpz" in case:  # backward's gathers ran on the node's own group: nothing of them crossed
            assert all(mine["secondary/all_gather"] == 0 for mine in counted)


def test_int8_gathers_move_a_quarter_of_the_bytes_and_train_alike(trained):
    for rank in trained:
        for name, reference in (("int8", "plain"), ("hpz+int8", "hpz")):
            for quantized, full in zip(rank[name]["phases"], rank[reference]["phases"]):
                got = sum(phase["job/all_gather"][1] for phase in quantized.values() if "job/all_gather" in phase)
                fp32 = sum(phase["job/all_gather"][1] for phase in full.values() if "job/all_gather" in phase)
                assert 0 < got <= 0.27 * fp32, name
        for a, b in zip(rank["int8"]["losses"], rank["plain"]["losses"]):
            assert a != b and abs(a - b) <= INT8_LOSS_RTOL * abs(b)


def test_secondary_shards_cost_one_share_of_the_units_until_their_backward_is_over(trained):
    for rank in trained:
        hpz = rank["hpz"]
        # the first step keeps every unit (nothing is held from forward into backward before the trace exists)
        assert hpz["peak_secondary"] == hpz["unit_bytes"] // PER_NODE
        ledger, real = hpz["after_forward"][0]
        assert ledger == hpz["unit_bytes"] // PER_NODE and ledger <= real <= ledger + (BLOCKS + 1) * 4096
        assert all(pair == (0, 0) for pair in hpz["after_backward"])  # released when the backward is over
        assert rank["plain"]["peak_secondary"] == 0


# -- in-process: the pieces ---------------------------------------------------------------------------


def test_int8_payloads_round_trip_within_half_a_step_of_each_block():
    torch.manual_seed(0)
    width = 3 * BLOCK + 17
    x = torch.randn(width) * torch.linspace(0.01, 10, width)
    x[BLOCK : 2 * BLOCK] = 0  # an all-zero block stays exactly zero
    size = payload_bytes(width)
    assert size == 4 * (4 + BLOCK) and size % 4 == 0
    rows = torch.zeros(2, 4 + size, dtype=torch.uint8)  # payloads at an offset inside a row, as coalesced
    scratch = torch.empty(padded(width))
    encode_int8(x, rows[0, 4:], scratch)
    encode_int8(-x, rows[1, 4:], scratch)
    out = torch.empty(2, width, dtype=torch.float32)
    decode_int8(rows[:, 4:], out, scratch)
    blocks = F.pad(x, (0, padded(width) - width)).view(-1, BLOCK).abs().amax(1)
    error = F.pad((out[0] - x).abs(), (0, padded(width) - width)).view(-1, BLOCK).amax(1)
    assert torch.all(error <= blocks / 254 * (1 + 1e-6))
    assert torch.equal(out[1], -out[0]) and torch.all(out[0, BLOCK : 2 * BLOCK] == 0)
    bf16 = torch.empty(1, width, dtype=torch.bfloat16)  # straight into the compute dtype
    decode_int8(rows[:1, 4:], bf16, scratch)
    assert torch.equal(bf16[0], out[0].to(torch.bfloat16))


def test_inter_node_bytes_per_collective():
    two_nodes = Topology(ranks_per_node=2)
    assert [two_nodes.node_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert two_nodes.remote_members([0, 1, 2, 3], me=1) == 2 and two_nodes.remote_members([2, 3], me=3) == 0
    assert inter_node_bytes("all_gather", 1000, n=4, remote=2) == 500
    assert inter_node_bytes("reduce_scatter", 1000, n=4, remote=2) == 500
    assert inter_node_bytes("all_reduce", 1000, n=4, remote=2) == 1000
    assert inter_node_bytes("all_gather", 1000, n=2, remote=0) == 0


def test_ranks_per_node_come_from_the_caller_else_torchrun_else_one_node(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert Topology.from_environment(8).ranks_per_node == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert Topology.from_environment(8).ranks_per_node == 4
    assert Topology.from_environment(8, ranks_per_node=2).ranks_per_node == 2


@pytest.mark.parametrize(
    ("knobs", "words"),
    [
        ({"secondary_shard_size": 0}, "secondary_shard_size"),
        ({"secondary_shard_size": "socket"}, "secondary_shard_size"),
        ({"secondary_shard_size": True}, "secondary_shard_size"),
        ({"quantize_gathers": "int4"}, "quantize_gathers"),
    ],
)
def test_bad_hierarchy_settings_fail_naming_the_setting(knobs, words):
    with pytest.raises(Zero3ConfigError, match=words):
        Zero3Config(**knobs)


def test_a_secondary_size_that_does_not_divide_the_ranks_fails_naming_the_setting():
    comm = Communicator(ranks_per_node=3)
    comm.world_size = 4  # as on four ranks
    with pytest.raises(Zero3ConfigError, match=r"secondary_shard_size='node'.*3 ranks per node.*\(4\)"):
        resolve_size("node", comm)
    with pytest.raises(Zero3ConfigError, match=r"secondary_shard_size=3"):
        resolve_size(3, comm)
    assert resolve_size(2, comm) == 2 and resolve_size(4, comm) is None  # the whole job: nothing to keep


def test_deepspeed_zero_plus_plus_keys_translate():
    block = {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8, "zero_quantized_weights": True}}
    config = Zero3Config.from_deepspeed(block)
    assert (config.secondary_shard_size, config.quantize_gathers) == (8, "int8")
    off = Zero3Config.from_deepspeed({"stage": 3, "zero_hpz_partition_size": 1, "zero_quantized_weights": False})
    assert (off.secondary_shard_size, off.quantize_gathers) == (None, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Zero3Config.from_deepspeed({"stage": 3, "zero_quantized_gradients": True})
    assert any("zero_quantized_gradients" in str(w.message) and "not implemented" in str(w.message) for w in caught)
    with pytest.raises(Zero3ConfigError, match="zero_quantized_weights"):
        Zero3Config.from_deepspeed({"stage": 3, "zero_quantized_weights": "yes"})


# -- through Lightning, on two SLURM nodes ------------------------------------------------------------

SCRIPT = Path(__file__).parents[1] / "scripts" / "hierarchy_run.py"


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("hierarchy")
    slurm_nodes(SCRIPT, ["--out", str(out)], nodes=2, per_node=PER_NODE, timeout=300, env={"PYTHONWARNINGS": "ignore"})
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


def test_lightning_resolves_node_from_devices_and_resumes_bitwise(launched):
    for rank in launched:
        assert rank["ranks_per_node"] == PER_NODE and rank["secondary_size"] == PER_NODE
        assert rank["hpz"] == rank["plain"]  # bitwise, per step
        assert rank["resumed"] == rank["hpz"][3:]
        secondary = rank["by_group"]["secondary/all_gather"]
        assert secondary["bytes"] > 0 and secondary["inter_node_bytes"] == 0


def test_comm_monitor_logs_the_bytes_that_crossed_nodes(launched):
    logged = launched[0]["logged_inter_node"]  # summed over the logged steps, mean over ranks
    for kind in ("all_gather", "reduce_scatter"):
        ledger = sum(rank["by_kind"][kind] for rank in launched) / WORLD
        assert logged[kind] == pytest.approx(ledger) and ledger > 0
