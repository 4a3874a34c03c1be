"""Hugging Face Mixtral under zero3 through Lightning, 2 CPU ranks: generation in the loop (a KV-cache loop in
``validation_step`` with a different number of new tokens per rank; ``generate(..., synced_gpus=True)`` in
``predict_step``) gives DDP's tokens, and training with routed experts matches
"ddp_find_unused_parameters_true" bitwise (see ``scripts/generation_run.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from distributed import run_script

SCRIPT = Path(__file__).parents[1] / "scripts" / "generation_run.py"


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    out = tmp_path_factory.mktemp("generation")
    run_script(SCRIPT, "--out", out)
    return out


def test_generation_with_a_kv_cache_and_per_rank_lengths_gives_ddps_tokens(out):
    zero3, ddp = (torch.load(out / f"generate-{s}.pt") for s in ("zero3", "ddp"))
    assert zero3["generated"] == ddp["generated"]
    # per rank, per batch: rank r generated 2 + 3r (+ batch index) tokens, while the ranks kept in step
    lengths = [[len(batch[0]) for batch in rank] for rank in zero3["generated"]]
    assert lengths == [[2, 3], [5, 6]]


def test_hugging_face_generate_with_synced_gpus_gives_ddps_tokens(out):
    zero3, ddp = (torch.load(out / f"generate-{s}.pt") for s in ("zero3", "ddp"))
    assert zero3["predicted"] == ddp["predicted"]
    lengths = [[len(batch[0]) for batch in rank] for rank in zero3["predicted"]]
    assert lengths == [[7, 7], [9, 9]]  # 6 prompt tokens, then 1 + 2r new ones


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_mixtral_training_matches_ddp_find_unused_parameters_bitwise(out, optimizer):
    zero3 = torch.load(out / f"train-zero3-{optimizer}.pt")
    ddp = torch.load(out / f"train-ddp_find_unused_parameters_true-{optimizer}.pt")
    assert len(zero3["losses"]) == 4 and zero3["losses"] == ddp["losses"]
    assert zero3["weights"].keys() == ddp["weights"].keys()
    for name, weight in ddp["weights"].items():
        assert torch.equal(zero3["weights"][name], weight), name
