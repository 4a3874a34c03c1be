"""Evaluation keeps units gathered across forward calls within ``inference_memory_budget`` (residency.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from distributed import run_script
from gpt import GPT, GPTConfig

from lightning_zero3 import Zero3Config, Zero3Engine
from lightning_zero3.engine.offload.source import ParamSource
from lightning_zero3.engine.schedule import gathers as gathers_module
from lightning_zero3.engine.schedule.residency import PROFILE_CALLS, UnitProfile, auto_budget, choose_resident
from lightning_zero3.engine.shard import flat_group as shard_module

SCRIPT = Path(__file__).parents[1] / "scripts" / "flows_run.py"


class _Unit:
    def __init__(self, name: str) -> None:
        self.name = name


def test_the_plan_is_a_knapsack_not_the_first_units():
    a, b, c = _Unit("a"), _Unit("b"), _Unit("c")
    profiles = {id(a): UnitProfile(6, 5.0, 1), id(b): UnitProfile(5, 3.0, 1), id(c): UnitProfile(5, 3.0, 1)}
    plan = choose_resident([a, b, c], profiles, budget=10)
    assert [u.name for u in plan.resident] == ["b", "c"] and plan.resident_bytes == 10  # 6 s saved, not 5
    assert choose_resident([a, b, c], profiles, budget=4).resident == []  # nothing fits
    idle = {id(u): UnitProfile(5, 0.0, 1) for u in (a, b, c)}  # nothing measurable: the budget is still used
    assert len(choose_resident([a, b, c], idle, budget=11).resident) == 2


def test_the_automatic_budget_is_what_training_held_less_the_streaming_window():
    assert auto_budget(1000, root_bytes=100, unit_bytes=[200, 200, 50]) == 1000 - 100 - 450
    assert auto_budget(None, root_bytes=100, unit_bytes=[200, 50]) == 3 * 200  # not trained: a step's staging
    assert auto_budget(100, root_bytes=100, unit_bytes=[200]) == 0


def test_outside_the_trainer_forward_calls_without_gradients_keep_units_and_training_releases_them():
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32)
    x = torch.randint(0, 64, (2, 12))
    outputs = {}
    for budget in (0, 10**9):
        torch.manual_seed(0)
        model = GPT(cfg)
        engine = Zero3Engine(
            model, Zero3Config(persistence_threshold=100, inference_memory_budget=budget, single_process_sharding=True)
        )
        with torch.no_grad():
            outputs[budget] = [model(x) for _ in range(8)]
        gathers = [rt.group.gathers for rt in engine.residency.candidates]
        if budget:
            assert all(g <= PROFILE_CALLS + 1 for g in gathers), gathers  # once the plan is made: kept
            assert engine.ledger.held["gathered_params"] > 0
        else:
            assert all(g == 8 for g in gathers), gathers  # every call gathers every unit
        model(x).sum().backward()  # a forward with gradients: training again, the plan is released
        assert engine.ledger.held["gathered_params"] == 0 and engine.gathered_resident_bytes() == 0
    assert all(torch.equal(a, b) for a, b in zip(outputs[0], outputs[10**9]))  # bitwise, fp32


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    out = tmp_path_factory.mktemp("inference")
    run_script(SCRIPT, "inference", "--out", out)
    return [json.loads((out / f"inference-rank{rank}.json").read_text()) for rank in range(2)]


def test_validation_that_generates_gives_the_same_tokens_under_every_budget(evaluated):
    for rank in evaluated:
        budgets = rank["budgets"]
        for name, run in budgets.items():
            assert run["generated"] == budgets["full"]["generated"], name  # tokens and logits, bitwise


def test_a_resident_unit_is_gathered_once_per_stage_not_once_per_token(evaluated):
    for rank in evaluated:
        budgets, calls = rank["budgets"], rank["calls"]
        assert budgets["zero"]["gathers"][1:] == [calls, calls]  # every block, every call
        assert all(g <= PROFILE_CALLS + 1 for g in budgets["full"]["gathers"])  # profile calls, then kept
        assert min(budgets["half"]["gathers"][1:]) <= PROFILE_CALLS + 1 < max(budgets["half"]["gathers"][1:])


def test_the_budget_holds_and_memory_returns_to_the_training_level_after_the_stage(evaluated):
    for rank in evaluated:
        for name, run in rank["budgets"].items():
            assert run["resident_bytes"] <= run["budget"], name
            assert run["gathered_after"] == 0 and run["resident_after"] == 0, name  # released when the stage ends
        # "auto" never holds more, gathered and staging together, than the training step did
        assert rank["budgets"]["auto"]["peak_transient"] <= rank["trained_peak"]


def _streaming_engine(budget: str, tier, tmp_path: Path):
    """A 6-block GPT under an inference budget of all (``"all"``) or half (``"half"``) of its units' bytes,
    its parameters offloaded to ``tier`` (None: not offloaded): ``(model, engine, unit sizes)``."""
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=6, n_head=2, n_embd=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    units = Zero3Engine(GPT(cfg), Zero3Config(persistence_threshold=100)).unit_sizes()
    limit = sum(units.values()) if budget == "all" else sum(units.values()) // 2
    knobs = {"offload_optimizer": tier, "offload_params": tier, "nvme_path": str(tmp_path)} if tier else {}
    engine = Zero3Engine(model, Zero3Config(persistence_threshold=100, inference_memory_budget=limit, **knobs))
    return model, engine, units


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_cold_units_stream_from_their_tier_and_give_the_all_resident_outputs(tmp_path, tier):
    x = torch.randint(0, 64, (2, 12))
    runs = {}
    for budget in ("all", "half"):
        model, engine, units = _streaming_engine(budget, tier if budget == "half" else None, tmp_path)
        reads = []
        with engine.ledger.watch() as peaks, torch.no_grad():
            outputs = []
            for _ in range(8):
                # bytes asked of the disk during the call (read_bytes grows as reads complete, on the I/O
                # threads, so a read-ahead finishing after the call's end would count in the next call)
                before = engine.offload.io.stats.requested_read_bytes if tier == "nvme" and engine.offload else 0
                outputs.append(model(x))
                after = engine.offload.io.stats.requested_read_bytes if tier == "nvme" and engine.offload else 0
                reads.append(after - before)
        plan = engine.residency.plan
        runs[budget] = {"outputs": outputs, "plan": plan, "peaks": peaks, "reads": reads, "units": units}
    half = runs["half"]
    assert all(torch.equal(a, b) for a, b in zip(half["outputs"], runs["all"]["outputs"]))  # bitwise
    resident = sum(half["units"][rt.name] for rt in half["plan"].resident)
    assert 0 < resident <= half["plan"].budget  # the hot units stay, within the budget
    cold = sum(half["units"].values()) - resident
    window = max(half["units"].values()) * 3 + half["units"]["<root>"]
    assert half["peaks"]["gathered_params"] <= half["plan"].budget + window
    if tier == "nvme":  # after the plan, every call reads the cold units from the disk, and no more
        assert all(abs(r - cold) <= max(half["units"].values()) for r in half["reads"][PROFILE_CALLS + 1 :])


def test_one_process_does_not_gather_ahead_a_unit_whose_read_is_still_in_flight(tmp_path, monkeypatch):
    # [Note: gathers ahead do not wait for the disk]: every read counts as in flight until it is waited
    # for, so a cold unit may only be gathered at its own start (else the compute waits for the disk there)
    monkeypatch.setattr(ParamSource, "still_reading", lambda self: self.pending_read is not None)
    events: list[tuple[str, str]] = []
    issue = shard_module.issue
    noted = lambda groups: (events.extend(("gather", g.name) for g in groups), issue(groups))  # noqa: E731
    monkeypatch.setattr(shard_module, "issue", noted)
    monkeypatch.setattr(gathers_module, "issue", noted)
    x = torch.randint(0, 64, (2, 12))
    outputs = {}
    for budget in ("all", "half"):
        model, _, _ = _streaming_engine(budget, "nvme", tmp_path)
        for i, block in enumerate(model.blocks):
            block.register_forward_pre_hook(lambda module, args, name=f"blocks.{i}": events.append(("start", name)), prepend=True)
        events.clear()
        with torch.no_grad():
            outputs[budget] = [model(x) for _ in range(PROFILE_CALLS + 3)]
    assert all(torch.equal(a, b) for a, b in zip(outputs["half"], outputs["all"]))
    cold_gathers = 0
    for at, (kind, name) in enumerate(events):
        if kind == "gather" and name.startswith("blocks."):
            last_start = next(n for k, n in reversed(events[:at]) if k == "start")
            assert last_start == name, f"{name} gathered ahead, at the start of {last_start}"
            cold_gathers += 1
    assert cold_gathers >= 3 * (PROFILE_CALLS + 3) // 2  # the cold half is gathered on every call
