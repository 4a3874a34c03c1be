"""Lifecycle states as enums: a unit's backward phase moves only along its legal transitions, and the
offload tier is a ``str`` enum that reads as the plain name everywhere a user sees it."""

from __future__ import annotations

import json
import types

import pytest

from lightning_zero3 import Zero3Config, Zero3ConfigError
from lightning_zero3.config.settings import OffloadTier
from lightning_zero3.engine.shard.runtime import BackwardPhase, UnitRuntime


def _runtime() -> UnitRuntime:
    group = types.SimpleNamespace(drop_secondary=lambda: None, trainable=True)
    return UnitRuntime("blocks.0", group, comm=None)


def test_a_units_backward_phase_moves_forward_only():
    unit = _runtime()
    assert unit.phase is BackwardPhase.IDLE and not unit.backward_over
    assert unit.start_backward() and unit.phase is BackwardPhase.STARTED and unit.backward_hold
    assert not unit.start_backward()  # a second output's gradient: already started
    assert unit.end_backward() and unit.phase is BackwardPhase.OVER and not unit.backward_hold
    assert not unit.end_backward() and not unit.start_backward()
    unit.mark_reduced()
    assert unit.phase is BackwardPhase.REDUCED and unit.backward_over
    with pytest.raises(AssertionError, match="'blocks.0' is REDUCED in backward, expected OVER"):
        unit.mark_reduced()
    unit.reset_backward()
    assert unit.phase is BackwardPhase.IDLE


def test_a_unit_is_reduced_only_once_its_backward_is_over():
    unit = _runtime()
    with pytest.raises(AssertionError, match="is IDLE in backward, expected OVER"):
        unit.mark_reduced()
    unit.start_backward()
    with pytest.raises(AssertionError, match="is STARTED in backward, expected OVER"):
        unit.mark_reduced()
    unit = _runtime()
    assert unit.end_backward() and unit.phase is BackwardPhase.OVER  # no pre-backward hook ran: straight to OVER


def test_the_offload_tier_reads_as_its_name():
    config = Zero3Config(offload_optimizer="nvme", offload_params="cpu", nvme_path="/tmp")
    assert config.offload_optimizer is OffloadTier.NVME and config.offload_params is OffloadTier.CPU
    assert config.offload_optimizer == "nvme" and f"{config.offload_params}" == "cpu"
    assert json.loads(json.dumps({"tier": config.offload_optimizer})) == {"tier": "nvme"}
    assert Zero3Config(offload_optimizer="device").offload_optimizer is None
    with pytest.raises(Zero3ConfigError, match=r"`offload_params='nvme'` needs `offload_optimizer`.*got `offload_optimizer='cpu'`"):
        Zero3Config(offload_optimizer="cpu", offload_params="nvme", nvme_path="/tmp")
