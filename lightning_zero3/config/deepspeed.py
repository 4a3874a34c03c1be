"""A DeepSpeed ``zero_optimization`` config, translated knob by knob into zero3's settings.

``translate(source)`` accepts a full DeepSpeed config (its ``zero_optimization`` block is read) or the
block itself, as a dict or a JSON file path, and returns ``{zero3 setting: value}``. Nothing is dropped
silently: every key that has no meaning here is named in one warning, with the reason.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Union

from ..errors import Zero3ConfigError

DeepSpeedSource = Union[str, os.PathLike, dict]

#: ``zero_optimization`` key -> zero3 setting
TOP_LEVEL = {
    "stage3_param_persistence_threshold": "persistence_threshold",
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "reduce_bucket_size": "reduce_bucket_size",
    "overlap_comm": "overlap_comm",
}

def _quantized_weights(value: Any) -> Any:
    if not isinstance(value, bool):
        raise Zero3ConfigError(f"zero3: DeepSpeed `zero_quantized_weights` must be true or false, got {value!r}.")
    return "int8" if value else None


#: ``zero_optimization`` key -> (zero3 setting, how its value translates); ZeRO++ (hpZ, qwZ)
CONVERTED = {
    # DeepSpeed's default 1 means off; otherwise the ranks a secondary shard is kept over
    "zero_hpz_partition_size": ("secondary_shard_size", lambda v: None if v == 1 else v),
    "zero_quantized_weights": ("quantize_gathers", _quantized_weights),
}

#: ``offload_optimizer.*`` / ``offload_param.*`` key -> zero3 setting (shared by both blocks)
OFFLOAD = {
    "device": None,  # offload_optimizer / offload_params, by block
    "nvme_path": "nvme_path",
    "pin_memory": "offload_pin_memory",
    "buffer_count": "offload_buffer_count",
    "buffer_size": "offload_buffer_size",
}
OFFLOAD_BLOCKS = {"offload_optimizer": "offload_optimizer", "offload_param": "offload_params"}

#: DeepSpeed keys that exist but mean nothing here, and why
NO_MEANING = {
    "contiguous_gradients": "gradient shards are always one contiguous flat buffer per unit",
    "reduce_scatter": "gradients are always reduce-scattered",
    "allgather_partitions": "parameters are always all-gathered",
    "allgather_bucket_size": "stage 1/2 only; gathers follow units and prefetch_bucket_size",
    "round_robin_gradients": "stage 1/2 only",
    "sub_group_size": "the optimizer steps per-parameter shard views, not sub-groups",
    "stage3_gather_16bit_weights_on_model_save": "set checkpoint_format='full' for a file of full weights",
    "stage3_gather_fp16_weights_on_model_save": "set checkpoint_format='full' for a file of full weights",
    "gather_16bit_weights_on_model_save": "set checkpoint_format='full' for a file of full weights",
    "elastic_checkpoint": "checkpoints do not depend on the world size",
    "load_from_fp32_weights": "master weights are always the fp32 shards",
    "ignore_unused_parameters": "unused parameters are always allowed (as DDP with find_unused_parameters=True; see docs/troubleshooting.md)",
    "legacy_stage1": "stage 1 only",
    "cpu_offload": "deprecated in DeepSpeed; use offload_optimizer",
    "cpu_offload_params": "deprecated in DeepSpeed; use offload_param",
    "cpu_offload_use_pin_memory": "deprecated in DeepSpeed; use offload_*.pin_memory",
    "memory_efficient_linear": "no custom linear kernels here",
    "zero_quantized_nontrainable_weights": (
        "frozen units are gathered like the others: zero_quantized_weights quantizes every unit's gathers"
    ),
    "zero_quantized_gradients": "ZeRO++ quantized gradients (qgZ) are not implemented: gradients reduce in reduce_dtype",
    "mics_shard_size": "MiCS is not implemented",
    "mics_hierarchical_params_gather": "MiCS is not implemented",
    "stage3_module_granularity_threshold": "units are chosen by unit_modules",
    "use_multi_rank_bucket_allreduce": "stage 1/2 only",
    "offload_optimizer.fast_init": "no such phase here",
    "offload_optimizer.ratio": "partial optimizer offload is not implemented",
    "offload_optimizer.pipeline_read": "NVMe reads are always overlapped",
    "offload_optimizer.pipeline_write": "NVMe writes are always overlapped",
    "offload_optimizer.pipeline": "NVMe I/O is always overlapped",
    "offload_param.max_in_cpu": "parameters offloaded to NVMe are not cached in host memory",
}


def load(source: DeepSpeedSource) -> dict[str, Any]:
    """The ``zero_optimization`` block of ``source``; other top-level keys of a full config are warned about."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise Zero3ConfigError(f"zero3: `deepspeed_config` file {str(path)!r} does not exist.")
        try:
            source = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise Zero3ConfigError(f"zero3: `deepspeed_config` file {str(path)!r} is not JSON: {error}.") from None
    if not isinstance(source, dict):
        raise Zero3ConfigError(
            f"zero3: `deepspeed_config` must be a dict or a JSON file path, got {type(source).__name__}."
        )
    if "zero_optimization" not in source:
        return dict(source)
    others = sorted(set(source) - {"zero_optimization"})
    if others:
        warnings.warn(
            f"zero3: DeepSpeed config keys outside `zero_optimization` are not read: {others}. Batch size, "
            "optimizer, precision and clipping are Lightning's Trainer flags and your configure_optimizers.",
            stacklevel=3,
        )
    block = source["zero_optimization"]
    if not isinstance(block, dict):
        raise Zero3ConfigError("zero3: DeepSpeed `zero_optimization` must be a JSON object.")
    return dict(block)


def translate(source: DeepSpeedSource) -> dict[str, Any]:
    """``{zero3 setting: value}`` for a DeepSpeed config; keys with no meaning here are named in one warning."""
    block = load(source)
    stage = block.pop("stage", 3)
    if stage != 3:
        raise Zero3ConfigError(
            f"zero3: the DeepSpeed config asks for ZeRO stage {stage!r}; this strategy is stage 3. Set "
            '"stage": 3, or use Lightning\'s DeepSpeed strategy for stages 1 and 2.'
        )
    knobs: dict[str, Any] = {}
    source_of: dict[str, str] = {}
    ignored: list[str] = []

    def put(setting: str, value: Any, key: str) -> None:
        if value == "auto":  # Hugging Face's placeholder: keep zero3's default
            ignored.append(f"{key}='auto' (zero3's default kept)")
            return
        if setting in knobs and knobs[setting] != value:
            raise Zero3ConfigError(
                f"zero3: DeepSpeed `{source_of[setting]}={knobs[setting]!r}` and `{key}={value!r}` both set "
                f"`{setting}`, which zero3 shares between optimizer and parameter offload; make them equal."
            )
        knobs[setting], source_of[setting] = value, key

    for key, value in block.items():
        if key in TOP_LEVEL:
            put(TOP_LEVEL[key], value, key)
        elif key in CONVERTED:
            setting, convert = CONVERTED[key]
            put(setting, value if value == "auto" else convert(value), key)
        elif key in OFFLOAD_BLOCKS:
            _offload(key, value or {}, put, ignored)
        else:
            ignored.append(_why(key))
    if ignored:
        warnings.warn(f"zero3: DeepSpeed settings with no effect here: {'; '.join(ignored)}.", stacklevel=3)
    return knobs


def _offload(block_name: str, block: Any, put, ignored: list[str]) -> None:
    if not isinstance(block, dict):
        raise Zero3ConfigError(f"zero3: DeepSpeed `{block_name}` must be a JSON object, got {block!r}.")
    for key, value in block.items():
        name = f"{block_name}.{key}"
        if key == "device":
            put(OFFLOAD_BLOCKS[block_name], None if value == "none" else value, name)
        elif key in OFFLOAD:
            put(OFFLOAD[key], value, name)
        else:
            ignored.append(_why(name))


def _why(key: str) -> str:
    reason = NO_MEANING.get(key, "not a DeepSpeed zero_optimization setting zero3 knows (a typo?)")
    return f"{key} ({reason})"


def merge(base: dict[str, Any], explicit: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed-translated settings overridden by explicitly passed ones, with a warning for each clash."""
    clashes = sorted(k for k in explicit if k in base and base[k] != explicit[k])
    if clashes:
        warnings.warn(
            "zero3: settings passed explicitly override the DeepSpeed config: "
            + ", ".join(f"{k}={explicit[k]!r} (DeepSpeed: {base[k]!r})" for k in clashes),
            stacklevel=3,
        )
    return {**base, **explicit}
