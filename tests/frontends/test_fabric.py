"""``Fabric(strategy="zero3")``: Fabric loops reproduce Fabric DDP's (``tests/scripts/fabric_run.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from distributed import run_script
from lightning.fabric import Fabric

import lightning_zero3
from lightning_zero3 import UnsupportedPrecisionError, Zero3FabricPrecision, Zero3FabricStrategy

SCRIPT = Path(__file__).parents[1] / "scripts" / "fabric_run.py"
LOSS_RTOL = 1e-6


@pytest.fixture(scope="module")
def fabric_out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fabric")
    run_script(SCRIPT, out)
    return out


@pytest.fixture(scope="module")
def ranks(fabric_out):
    return [torch.load(fabric_out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_nothing_of_zero3_runs_on_into_the_interpreters_exit(fabric_out):
    """[Note: process groups closed at exit]: nine Fabrics in one process, none torn down (Fabric never
    calls ``teardown``): once zero3's exit handler has run, no watchdog thread still beats on the store
    (rank 0's, gone when rank 0 ends) and no gloo thread is left to be ended by the finalization."""
    records = [json.loads(file.read_text()) for file in fabric_out.glob("exit-*.json")]
    assert len(records) == 2
    assert all(record == {"watchdogs": [], "gloo_threads": 0} for record in records), records


@pytest.mark.parametrize("case", ["clip", "accum", "raw", "seeded", "hub"])
def test_fabric_zero3_losses_equal_fabric_ddps(ranks, case):
    """Clipping by the global norm, accumulation under ``no_backward_sync``, a model built with
    ``init_module(empty_init=True)`` whose weights come from ``fabric.load_raw`` of a plain state dict, one
    so built that starts from its seeded initialisation, and a Hub-layout Mixtral (per-expert tensors in the
    file, fused experts in the model) read by ``load_pretrained`` against DDP's ``from_pretrained``."""
    for result in ranks:
        if case == "hub":
            assert result["hub-zero3"]["per_expert_file"]
        zero3, ddp = result[f"{case}-zero3"]["losses"], result[f"{case}-ddp"]["losses"]
        assert len(zero3) == len(ddp) >= 3
        assert zero3 == pytest.approx(ddp, rel=LOSS_RTOL, abs=0)


def test_a_checkpoint_loaded_where_the_model_is_built_draws_nothing_as_from_pretrained(ranks):
    """[Note: draws wait for a load]: ``load_pretrained`` inside ``init_module(empty_init=True)`` leaves every
    rank's generator where DDP's ``from_pretrained`` leaves it."""
    for result in ranks:
        assert torch.equal(result["hub-zero3"]["rng_after_load"], result["hub-ddp"]["rng_after_load"])


def test_a_seeded_empty_init_model_starts_from_fabric_ddps_weights(ranks):
    """[Note: eager construction replayed]: built on the meta device and initialised unit by unit, the model
    gets the very numbers DDP's eager build draws, and every rank's generator ends where DDP's does."""
    for result in ranks:
        zero3, ddp = result["seeded-zero3"], result["seeded-ddp"]
        assert zero3["start"].keys() == ddp["start"].keys()
        for name, weight in ddp["start"].items():
            assert torch.equal(zero3["start"][name], weight), name
        assert torch.equal(zero3["rng"], ddp["rng"])
        assert zero3["losses"][0] == ddp["losses"][0]


def test_model_states_are_sharded(ranks):
    for result in ranks:
        zero3, ddp = result["clip-zero3"], result["clip-ddp"]
        assert zero3["trainable_units"] >= 3
        assert zero3["optimizer_state_bytes"] == pytest.approx(ddp["optimizer_state_bytes"] / 2, rel=0.01)


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_save_load_resumes_bitwise(ranks, fmt):
    for result in ranks:
        run = result[f"resume-{fmt}"]
        assert run["resumed"] == run["straight"]  # bitwise, into a model that started from other weights
        assert run["step"] == 3 and run["rest"] == []
        assert run["is_file"] is (fmt == "full")


def test_a_full_checkpoint_is_fabric_ddps_own_file(ranks):
    for result in ranks:
        assert result["full-into-ddp"]["losses"] == result["resume-full"]["straight"]
        assert result["full-into-ddp"]["step"] == 3


def test_the_names_are_in_fabrics_registry_and_settings_and_flags_are_checked():
    fabric = Fabric(strategy="zero3_offload", accelerator="cpu", devices=1, precision="bf16-mixed")
    assert isinstance(fabric.strategy, Zero3FabricStrategy)
    assert fabric.strategy.config.offload_optimizer == "cpu" and fabric.strategy.config.offload_params == "cpu"
    assert isinstance(fabric.strategy.precision, Zero3FabricPrecision)
    assert fabric.strategy.precision.compute_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="persistence_threshold"):
        Zero3FabricStrategy(persistence_threshold=-1)
    with pytest.raises(UnsupportedPrecisionError, match="reduce_dtype='fp16'"):
        Fabric(strategy=Zero3FabricStrategy(reduce_dtype="fp16"), accelerator="cpu", devices=1, precision="bf16-mixed")
    assert lightning_zero3.Zero3FabricStrategy.strategy_name == "zero3"


def test_init_weights_is_zero3s_hook_when_it_takes_the_module():
    """A LightningModule's ``init_weights`` must take the module; a plain model's zero-argument one (Hugging
    Face's whole-model ``init_weights()``, which a Fabric user's model has) is its own, not zero3's hook."""
    import lightning.pytorch as pl

    from lightning_zero3.frontends.shared_setup import init_hook

    class Hooked(pl.LightningModule):
        def init_weights(self, module):
            pass

    class Wrong(pl.LightningModule):
        def init_weights(self):
            pass

    class HubLike(torch.nn.Module):
        def init_weights(self):
            pass

    hooked = Hooked()
    assert init_hook(hooked) == hooked.init_weights
    assert init_hook(HubLike()) is None
    with pytest.raises(TypeError, match="init_weights` must take one argument"):
        init_hook(Wrong())
