"""fp32 training under "zero3" (and its offload flavours) reproduces "ddp" step by step, through Lightning,
at world sizes 1, 2 and 4."""

from __future__ import annotations

import inspect
import math
import os
from pathlib import Path

import pytest
import torch
from distributed import run_script
from gpt import GPTModule

SCRIPT = Path(__file__).parents[1] / "scripts" / "parity_run.py"
LOSS_RTOL = 1e-5
# Bitwise equality is expected where reduction order matches DDP's; summing in another order (4 ranks,
# accumulation into shards, clipping's norm) moves weights by a few 1e-6 after 10 AdamW steps.
WEIGHT_ATOL = 5e-5

CASES = {
    1: ["base", "accum"],
    2: ["base", "accum", "clip_norm", "clip_value", "untied", "frozen", "checkpointing", "scheduler", "sgd",
        "sharded_init"],
    4: ["base", "accum", "clip_norm", "checkpointing"],
}
# bf16-mixed runs (20 steps), compared with DDP under the same flag, world size 2
BF16 = ["bf16", "bf16_reduce_bf16"]
BF16_TRUE = ["bf16_true", "fp32_20"]
# zero3 settings that train "base" as it is, run by zero3 alone at world size 2 (parity_run.ZERO3_ONLY)
SETTINGS = ["unshard_threads", "nvme_chunks"]
# Measured: at most 1.2e-4 relative over 20 steps. zero3 gathers bf16 copies of the fp32 master weights,
# so LayerNorm weights and embeddings enter forward rounded to bf16, where DDP's autocast keeps them fp32
# (only matmul inputs are cast): the two differ by a few bf16 ulps (2^-8 = 3.9e-3) in some activations,
# which averages down in the loss. 5e-3, about one bf16 ulp of the loss, keeps margin over the measured
# figure and stays inside the 1e-2 the issue allows.
BF16_LOSS_RTOL = 5e-3


def adam_drift_bound(lr: float, steps: int, betas: tuple[float, float]) -> float:
    """The most two AdamW runs that see slightly different gradients can drift apart, per element.

    Adam's step is lr * m_hat / (sqrt(v_hat) + eps), and |m_hat / sqrt(v_hat)| is bounded whatever the
    gradients are (Cauchy-Schwarz over the two moving averages, with r = beta1^2 / beta2 < 1):
        B_t = (1 - b1) / (1 - b1^t) * sqrt((1 - b2^t) / (1 - b2)) * sqrt((1 - r^t) / (1 - r))
    (1.00 at t = 1, 1.16 at t = 20 for the default betas). Two runs whose steps point opposite ways move
    apart by at most 2 * lr * B_t per step; decoupled weight decay shrinks both weights alike (it only
    narrows the gap); eps only shortens steps. Summed over the steps: the bound."""
    b1, b2 = betas
    r = b1 * b1 / b2
    return sum(
        2 * lr * (1 - b1) / (1 - b1**t) * math.sqrt((1 - b2**t) / (1 - b2)) * math.sqrt((1 - r**t) / (1 - r))
        for t in range(1, steps + 1)
    )


# bf16-mixed final weights against DDP's, per element. Why the bound is Adam's and not a multiple of bf16's
# unit roundoff u = 2^-8: zero3 computes with bf16 copies of the masters where DDP's autocast keeps some
# fp32, so each gradient element differs by about u relative. Where a gradient is signal, that moves
# Adam's step by about u * lr (20 steps x 1e-3 x 3.9e-3 = 7.8e-5 in all). But an element whose gradient
# is itself rounding noise gets a full step of either sign from Adam's normalisation, and this GPT has
# them: the attention's key bias (``attn.bias[n_embd:2 n_embd]``) adds the same q.b to every logit of a
# query's row, which softmax ignores, so its exact gradient is zero. Those elements can drift by the full
# bound; measured (2 ranks, 20 steps, lr 1e-3): key bias 0.0204 apart (0.48 of the bound), every other
# element within 3.8e-3 (wpe, fc_proj), both reduce dtypes alike.
BF16_STEPS = 20
BF16_WEIGHT_ATOL = adam_drift_bound(
    inspect.signature(GPTModule.__init__).parameters["lr"].default, BF16_STEPS, torch.optim.AdamW([torch.zeros(1)]).defaults["betas"]
)  # fmt: skip


# the offload strategies, compared with "zero3" and "ddp" of the same launch directory (world size 2)
OFFLOAD_STRATEGIES = ["zero3_offload", "zero3_offload_nvme"]
OFFLOAD_VARIANTS = ["base", "accum", "clip_norm"]


def _launch(out: Path, devices: int, variants: list[str], strategies: str = "zero3,ddp") -> None:
    run_script(SCRIPT, "--devices", devices, "--out", out, "--strategies", strategies, "--variants", ",".join(variants),
               timeout=900)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One launch per world size trains every variant under both strategies (saves start-up time)."""
    out = tmp_path_factory.mktemp("parity")
    for devices, variants in CASES.items():
        _launch(out / str(devices), devices, variants + (BF16 + BF16_TRUE + SETTINGS if devices == 2 else []))
    _launch(out / "2", 2, OFFLOAD_VARIANTS, ",".join(OFFLOAD_STRATEGIES))
    return out


@pytest.mark.parametrize("devices,variant", [(d, v) for d, vs in CASES.items() for v in vs])
def test_zero3_matches_ddp(runs, devices, variant):
    zero3 = torch.load(runs / str(devices) / f"zero3-{variant}.pt")
    ddp = torch.load(runs / str(devices) / f"ddp-{variant}.pt")
    assert len(zero3["losses"]) == len(ddp["losses"]) >= 10
    for step, (a, b) in enumerate(zip(zero3["losses"], ddp["losses"])):
        assert abs(a - b) <= LOSS_RTOL * abs(b), f"step {step}: zero3 {a} vs ddp {b}"
    assert zero3["losses"][-1] < zero3["losses"][0]  # it trains
    assert zero3["weights"].keys() == ddp["weights"].keys()
    for name, weight in ddp["weights"].items():
        torch.testing.assert_close(zero3["weights"][name], weight, rtol=0, atol=WEIGHT_ATOL, msg=name)
    report = zero3["memory"]["report"]
    if devices > 1:
        assert report["param_shards"] > 0 and report["gathered_params"] == 0
    else:  # one process keeps its units gathered, its shards being the gathered buffers (shard/flat_group.py)
        assert report["param_shards"] == 0 and report["gathered_params"] > 0


def test_a_seeded_model_built_in_configure_model_starts_from_ddps_weights(runs):
    """[Note: eager construction replayed]: under zero3 ``configure_model`` builds the GPT on the meta device
    and rank 0 initialises it unit by unit, yet it starts from the numbers DDP's eager build draws after
    ``seed_everything``, and the generator is where DDP's is."""
    zero3 = torch.load(runs / "2" / "zero3-sharded_init.pt")
    ddp = torch.load(runs / "2" / "ddp-sharded_init.pt")
    assert zero3["start"].keys() == ddp["start"].keys()
    for name, weight in ddp["start"].items():
        assert torch.equal(zero3["start"][name], weight), name
    assert torch.equal(zero3["rng"], ddp["rng"])
    assert zero3["losses"][0] == ddp["losses"][0]


# Offload steps AdamW with torch's fused CPU kernel, which rounds differently from the per-tensor loop
# that DDP and "zero3" run: 1 ulp per step. Parameters whose gradient is numerical noise (the attention
# key bias, which softmax ignores) turn that into different signs of Adam's normalised update. Measured
# (2 ranks, 10 steps): losses within 1.1e-7 relative, weights within 8e-6 of DDP's; the existing tolerances hold.
@pytest.mark.parametrize("strategy,variant", [(s, v) for s in OFFLOAD_STRATEGIES for v in OFFLOAD_VARIANTS])
def test_offload_matches_zero3_and_ddp(runs, strategy, variant):
    offload = torch.load(runs / "2" / f"{strategy}-{variant}.pt")
    for reference in ("zero3", "ddp"):
        other = torch.load(runs / "2" / f"{reference}-{variant}.pt")
        assert len(offload["losses"]) == len(other["losses"]) >= 10
        for step, (a, b) in enumerate(zip(offload["losses"], other["losses"])):
            assert abs(a - b) <= LOSS_RTOL * abs(b), f"step {step}: {strategy} {a} vs {reference} {b}"
        for name, weight in other["weights"].items():
            torch.testing.assert_close(offload["weights"][name], weight, rtol=0, atol=WEIGHT_ATOL, msg=name)
    report = offload["memory"]["report"]
    assert report["param_shards"] == 0 and report["gathered_params"] == 0  # parameter shards offloaded
    if strategy == "zero3_offload":
        assert report["offload_host"] > 0 and report["offload_nvme"] == 0
    else:  # masters, gradients and Adam's moments on disk; only the step counters stay in memory
        assert report["offload_nvme"] >= 4 * report["optimizer_state"] > 0
        # pooled host buffers, never more than offload_buffer_count (4) groups' master, gradient and moments
        largest_group = max(offload["memory"]["units"].values()) // 2  # a unit's shard on 2 ranks
        assert report["peak_offload_host"] <= 4 * 4 * largest_group
        assert offload["memory"]["swap_io"]["read"] > 0 and offload["memory"]["swap_io"]["written"] > 0
        assert not any((runs / "2" / "nvme").glob("lightning_zero3-*/*"))  # swap folders removed at the end


@pytest.mark.parametrize("variant", BF16)
def test_bf16_mixed_tracks_ddp_bf16_mixed(runs, variant):
    zero3 = torch.load(runs / "2" / f"zero3-{variant}.pt")
    ddp = torch.load(runs / "2" / f"ddp-{variant}.pt")
    assert len(zero3["losses"]) == len(ddp["losses"]) == BF16_STEPS
    for step, (a, b) in enumerate(zip(zero3["losses"], ddp["losses"])):
        assert abs(a - b) <= BF16_LOSS_RTOL * abs(b), f"step {step}: zero3 {a} vs ddp {b}"
    assert zero3["losses"][-1] < zero3["losses"][0] - 0.1
    assert 0.04 < BF16_WEIGHT_ATOL < 0.045  # lr 1e-3, 20 steps: see BF16_WEIGHT_ATOL
    assert zero3["weights"].keys() == ddp["weights"].keys()
    for name, weight in ddp["weights"].items():  # master weights come back in fp32, each within the bound
        assert zero3["weights"][name].dtype == torch.float32, name
        torch.testing.assert_close(zero3["weights"][name], weight, rtol=0, atol=BF16_WEIGHT_ATOL, msg=name)


def test_bf16_gathers_move_half_the_bytes_of_fp32(runs):
    fp32 = torch.load(runs / "2" / "zero3-fp32_20.pt")["memory"]  # 20 steps, like the bf16 runs
    bf16 = torch.load(runs / "2" / "zero3-bf16.pt")["memory"]
    bf16_reduce = torch.load(runs / "2" / "zero3-bf16_reduce_bf16.pt")["memory"]
    moved = lambda memory, kind: memory["comm_bytes"][kind]  # noqa: E731
    assert moved(bf16, "all_gather") == 0.5 * moved(fp32, "all_gather")
    assert moved(bf16, "reduce_scatter") == moved(fp32, "reduce_scatter")  # default: reduced in fp32
    assert moved(bf16_reduce, "reduce_scatter") == 0.5 * moved(fp32, "reduce_scatter")
    # model states keep fp32 masters: the same bytes as under fp32
    for key in ("param_shards", "grad_shards", "optimizer_state"):
        assert bf16["report"][key] == fp32["report"][key], key


def test_bf16_true_matches_ddp_bf16_true_exactly(runs):
    zero3 = torch.load(runs / "2" / "zero3-bf16_true.pt")
    ddp = torch.load(runs / "2" / "ddp-bf16_true.pt")
    assert torch.load(runs / "2" / "zero3-fp32_20.pt")["losses"] == torch.load(runs / "2" / "ddp-fp32_20.pt")["losses"]
    assert zero3["losses"] == ddp["losses"] and len(ddp["losses"]) == 20  # same bf16 arithmetic, same order
    for name, weight in ddp["weights"].items():
        assert zero3["weights"][name].dtype == torch.bfloat16
        torch.testing.assert_close(zero3["weights"][name], weight, rtol=0, atol=0, msg=name)


# -- settings, each shown to do what it says (the runs of SETTINGS against DDP's "base") -------------


def _assert_trains_as_ddp_base(runs, variant: str) -> dict:
    zero3 = torch.load(runs / "2" / f"zero3-{variant}.pt")
    ddp = torch.load(runs / "2" / "ddp-base.pt")
    assert len(zero3["losses"]) == len(ddp["losses"]) >= 10
    for step, (a, b) in enumerate(zip(zero3["losses"], ddp["losses"])):
        assert abs(a - b) <= LOSS_RTOL * abs(b), f"step {step}: zero3 {a} vs ddp {b}"
    assert zero3["weights"].keys() == ddp["weights"].keys()
    for name, weight in ddp["weights"].items():
        torch.testing.assert_close(zero3["weights"][name], weight, rtol=0, atol=WEIGHT_ATOL, msg=name)
    return zero3


@pytest.mark.parametrize("devices", sorted(CASES))
def test_unshard_gives_every_rank_ddps_full_weights_and_lets_the_engine_go(runs, devices):
    """``lightning_zero3.unshard(module)`` after fit: the module's own weights (not the engine's gathered
    copy) are DDP's, and the module is no longer sharded."""
    zero3 = torch.load(runs / str(devices) / "zero3-base.pt")
    ddp = torch.load(runs / str(devices) / "ddp-base.pt")
    assert zero3["engine_after_fit"] and not zero3["engine_after_unshard"]
    assert zero3["unsharded"].keys() == ddp["weights"].keys()
    for name, weight in ddp["weights"].items():
        assert torch.equal(zero3["unsharded"][name], zero3["weights"][name]), name  # what the shards held
        torch.testing.assert_close(zero3["unsharded"][name], weight, rtol=0, atol=WEIGHT_ATOL, msg=name)


def test_unshard_after_fit_leaves_the_module_with_ddps_full_weights(runs):
    # The same run trains with cpu_threads above the default (see the next test); more threads split the
    # matmuls' sums differently: measured within 7.7e-6 of DDP (1 thread), inside WEIGHT_ATOL.
    zero3 = _assert_trains_as_ddp_base(runs, "unshard_threads")  # its weights: the module's state_dict()
    assert not zero3["engine_after_fit"]  # fit ended with the module unsharded, no engine attached


def test_cpu_threads_sets_the_compute_threads_of_every_rank(runs):
    setting = len(os.sched_getaffinity(0)) + 1  # parity_run's: above what any rank gets by default here
    assert torch.load(runs / "2" / "zero3-unshard_threads.pt")["threads"] == [setting, setting]
    default = torch.load(runs / "2" / "zero3-base.pt")["threads"]
    assert len(default) == 2 and all(1 <= threads < setting for threads in default)


def test_an_offload_buffer_below_a_shard_splits_every_larger_nvme_request_into_pieces(runs):
    """``offload_buffer_size`` = 4096 elements (16 KiB per piece), below every block's shard (96 KiB a rank):
    each request goes to the file in pieces of at most that size, and training gives DDP's losses."""
    zero3 = _assert_trains_as_ddp_base(runs, "nvme_chunks")
    io, chunk = zero3["io"], 4096 * 4
    for kind in ("write", "read"):
        requests, pieces = io["requests"][kind], io["pieces"][kind]
        assert requests and {asked for _, asked in requests} == {chunk}, kind
        assert sum(nbytes for nbytes, _ in requests) == sum(pieces), kind  # every byte through a piece
        assert max(pieces) <= chunk, kind
        split = [nbytes for nbytes, _ in requests if nbytes > chunk]
        assert split and max(nbytes for nbytes, _ in requests) >= 6 * chunk, kind  # a block's shard: 6 pieces
        least = sum(-(-nbytes // chunk) for nbytes, _ in requests)  # ceil(bytes / piece) per request
        if kind == "write":
            assert len(pieces) == least
        else:  # a read may split once more where its direct-I/O blocks end (aio.py, [Note: direct reads])
            assert least <= len(pieces) <= least + len(requests)
