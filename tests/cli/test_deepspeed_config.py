"""DeepSpeed ``zero_optimization`` configs translated knob by knob; nothing dropped silently."""

from __future__ import annotations

import json
import warnings

import pytest

from lightning_zero3 import Zero3Config, Zero3ConfigError, Zero3Strategy

DEEPSPEED = {
    "train_micro_batch_size_per_gpu": 4,
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": 1e4,
        "stage3_prefetch_bucket_size": 2e7,
        "stage3_max_live_parameters": 3e8,
        "stage3_max_reuse_distance": 1e6,
        "reduce_bucket_size": 5e5,
        "overlap_comm": False,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": False, "buffer_count": 5},
        "offload_param": {"device": "cpu", "nvme_path": "/local_nvme", "buffer_size": 1e7, "max_in_cpu": 1e9},
    },
}


def _translate(source, **overrides):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = Zero3Config.from_deepspeed(source, **overrides)
    return config, [str(w.message) for w in caught]


def test_every_meaningful_knob_is_translated():
    config, _ = _translate(DEEPSPEED)
    assert config == Zero3Config(
        persistence_threshold=10_000,
        prefetch_bucket_size=20_000_000,
        max_live_parameters=300_000_000,
        max_reuse_distance=1_000_000,
        reduce_bucket_size=500_000,
        overlap_comm=False,
        offload_optimizer="nvme",
        offload_params="cpu",
        nvme_path="/local_nvme",
        offload_pin_memory=False,
        offload_buffer_count=5,
        offload_buffer_size=10_000_000,
    )


def test_knobs_without_meaning_here_are_named_in_one_warning_each_kind():
    _, messages = _translate(DEEPSPEED)
    ignored = next(m for m in messages if "no effect here" in m)
    for key in ("contiguous_gradients", "sub_group_size", "offload_param.max_in_cpu"):
        assert key in ignored
    outside = next(m for m in messages if "outside `zero_optimization`" in m)
    assert "train_micro_batch_size_per_gpu" in outside
    _, messages = _translate({"stage": 3, "stage3_prefetch_bucket_sise": 5})
    assert any("stage3_prefetch_bucket_sise" in m and "typo" in m for m in messages)


def test_the_block_alone_and_a_json_file_are_accepted(tmp_path):
    block_only, _ = _translate(DEEPSPEED["zero_optimization"])
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DEEPSPEED))
    from_file, _ = _translate(str(path))
    assert block_only == from_file == _translate(DEEPSPEED)[0]


@pytest.mark.parametrize(
    "source,words",
    [
        ({"zero_optimization": {"stage": 2}}, ["stage 2", "stage 3"]),
        ({"stage": 3, "stage3_max_live_parameters": -1}, ["max_live_parameters", ">= 0"]),
        ({"stage": 3, "offload_optimizer": {"device": "disk"}}, ["offload_optimizer", "nvme"]),
        (
            {"offload_optimizer": {"device": "nvme", "nvme_path": "/a"}, "offload_param": {"device": "nvme", "nvme_path": "/b"}},
            ["offload_optimizer.nvme_path", "offload_param.nvme_path", "make them equal"],
        ),
        ("/no/such/ds_config.json", ["does not exist"]),
    ],
)
def test_bad_deepspeed_configs_fail_with_the_setting_named(source, words):
    with pytest.raises(Zero3ConfigError) as error:
        _translate(source)
    for word in words:
        assert word in str(error.value)


def test_strategy_keywords_override_the_deepspeed_config_with_a_warning():
    with pytest.warns(UserWarning, match=r"persistence_threshold=5 \(DeepSpeed: 10000.0\)"):
        strategy = Zero3Strategy(deepspeed_config=DEEPSPEED, persistence_threshold=5)
    assert strategy.config.persistence_threshold == 5
    assert strategy.config.max_live_parameters == 300_000_000
    base = Zero3Config(unit_modules=("Block",))
    with pytest.warns(UserWarning):
        strategy = Zero3Strategy(config=base, deepspeed_config=DEEPSPEED)
    assert strategy.config.unit_modules == ("Block",) and strategy.config.reduce_bucket_size == 500_000
