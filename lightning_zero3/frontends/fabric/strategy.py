"""``Zero3FabricStrategy``: zero3 behind Lightning Fabric's door, ``Fabric(strategy="zero3")``.

The second front door onto the same engine as ``Zero3Strategy`` (the Trainer's): processes, the engine
and the precision flags come from ``shared_setup.py`` and ``precision_core.py`` (Fabric's precision plugin
is ``precision.py``); this file only answers Fabric's calls. What each call does under zero3:

- ``fabric.init_module(empty_init=True)``: parameters on the meta device (buffers real), built unit by
  unit straight into shards at ``setup``; without ``empty_init`` the model is built whole and sharded.
- ``fabric.setup(model, optimizer)`` (joint) or ``setup_module`` then ``setup_optimizers``: the model is
  sharded in place (hooks on its modules, the same parameter objects), the optimizer steps the shards.
  A ``torch.compile``d model is unwrapped, sharded and compiled again by Fabric.
- ``fabric.backward``, ``clip_gradients`` (by the norm of the full gradient, or by value), the fp16 loss
  scaler agreed by all ranks: as in the Trainer.
- ``fabric.no_backward_sync(model)``: nothing to skip. Each micro-batch's gradients are reduce-scattered
  into this rank's shard at once (so accumulating costs no memory beyond the 1/N gradient shard), and
  the result is the same as with the sync skipped.
- ``fabric.save(path, {"model": model, "optimizer": optimizer, ...})``: a sharded checkpoint directory
  (``checkpoint_format="sharded"``, each rank its own pieces) or one file in Fabric DDP's layout
  (``"full"``, written unit by unit; a ``filter`` on the model keeps some of its tensors, and units
  without any are not gathered); ``fabric.load`` takes either into the shards, on any number of
  ranks for the sharded one; ``fabric.load_raw(path, model)`` reads a full state dict (or a Hugging Face
  checkpoint) straight into the shards with ``load_pretrained``.

One model per strategy (the engine it builds); a second, different model fails at its ``setup``.
"""

from __future__ import annotations

from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import ParallelStrategy, _StrategyRegistry
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.strategy import _apply_filter, _BackwardSyncControl, _Sharded, _Stateful
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.types import ReduceOp
from torch import Tensor, nn
from torch.optim import Optimizer

from ...checkpoint import is_sharded_checkpoint, load_sharded_checkpoint, save_sharded_checkpoint
from ...checkpoint.files import load_checked_file, save_file_atomically
from ...checkpoint.full import save_full_checkpoint
from ...config.knobs import build_config
from ...config.settings import Zero3Config
from ...engine import Zero3Engine, engine_of
from ...engine.comm.collective_log import FABRIC_SAVE_FIX, in_phase
from ...engine.layout.materialize import move_real_tensors
from ...errors import Zero3ConfigError
from ...pretrained import load_pretrained
from ..precision_core import require_engine
from ..shared_setup import ProcessesMixin, built_on_meta, new_engine, register_names
from .precision import Zero3FabricPrecision, to_fabric_precision


class _NothingToSkip(_BackwardSyncControl):
    """``no_backward_sync``: zero3 reduces each micro-batch into the shards (see the module's docstring)."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> Any:
        return nullcontext()


class Zero3FabricStrategy(ProcessesMixin, ParallelStrategy, _Sharded):
    """ZeRO stage 3 for Fabric: ``Fabric(strategy="zero3")``, or ``Zero3FabricStrategy(**settings)`` with any
    setting of :class:`~lightning_zero3.Zero3Config` as a keyword (or ``config=`` / ``deepspeed_config=``)."""

    strategy_name = "zero3"

    def __init__(
        self,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision: Optional[Precision] = None,
        config: Optional[Zero3Config] = None,
        deepspeed_config: Optional[Union[str, dict]] = None,
        **settings: Any,
    ) -> None:
        self.config = build_config(config, deepspeed_config, settings)  # a bad setting fails here
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision=precision)  # fmt: skip
        self._num_nodes = 1
        self._engine: Optional[Zero3Engine] = None
        self._backward_sync_control = _NothingToSkip()
        self._init_processes()

    # -- what Fabric looks up on a distributed strategy ---------------------------------------------

    @property
    def precision(self) -> Zero3FabricPrecision:
        if self._precision is None:
            self._precision = Zero3FabricPrecision()
        return self._precision

    @precision.setter
    def precision(self, precision: Optional[Precision]) -> None:
        plugin = to_fabric_precision(precision)
        if plugin is not None:
            plugin.dtype_policy(self.config.reduce_dtype)  # a flag that does not go with reduce_dtype fails now
        self._precision = plugin

    # -- processes --------------------------------------------------------------------------------

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        self._start_processes()

    def _set_rank_zero_only(self, rank: int) -> None:
        super()._set_rank_zero_only(rank)
        rank_zero_only.rank = rank

    # -- building and sharding the model ------------------------------------------------------------

    def module_init_context(self, empty_init: Optional[bool] = None) -> Any:
        """``empty_init=True``: parameters on the meta device, built into shards at ``setup`` (see
        [Note: only parameters on the meta device] in engine/layout/materialize.py)."""
        stack = ExitStack()
        if self.root_device.type != "cpu":
            stack.enter_context(self.root_device)
        if empty_init:
            stack.enter_context(built_on_meta(self.config, self.root_device))
        stack.enter_context(self.precision.module_init_context())
        return stack

    def module_sharded_context(self) -> Any:
        return built_on_meta(self.config, self.root_device)

    def module_to_device(self, module: nn.Module) -> None:
        move_real_tensors(module, self.root_device)  # meta parameters stay: the engine builds them as shards

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None) -> tuple:
        module = self.setup_module(module)
        return module, [self.setup_optimizer(optimizer) for optimizer in optimizers], scheduler

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Shard ``module`` in place (it is returned as it is, with zero3's hooks on its modules)."""
        engine = engine_of(module)
        if engine is None:
            if self._engine is not None:
                raise Zero3ConfigError(
                    "zero3: this Fabric strategy shards one model and has sharded another already; set the two "
                    "up as one module (an nn.ModuleDict of both), or use one Fabric per model."
                )
            dtypes = self.precision.dtype_policy(self.config.reduce_dtype)
            engine = new_engine(module, self.config, self.root_device, dtypes, self.num_processes)
        self._engine = engine
        self.precision.engine = engine
        self.precision.device_type = self.root_device.type
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """The optimizer steps this rank's shards from now on (its parameters are the model's own)."""
        if self._engine is None:
            raise RuntimeError("zero3: set the model up before its optimizer (`fabric.setup_module(model)` first).")
        if optimizer not in self._engine.optimizers:
            self._engine.shard_optimizer(optimizer)
        return optimizer

    # -- gradients ------------------------------------------------------------------------------

    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> Tensor:  # fmt: skip
        """Clip by the norm of the full gradient (a collective), as DDP's ``clip_grad_norm_`` sees it."""
        self.precision.unscale_gradients(optimizer)
        engine = require_engine(self._engine)
        total = engine.clip_grad_norm_(float(max_norm), float(norm_type), params=list(self.precision.main_params(optimizer)))
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"zero3: the total norm of order {norm_type} of the gradients is non-finite ({float(total)}), so "
                "clipping cannot scale them; pass `error_if_nonfinite=False` to clip anyway."
            )
        return total

    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: Union[float, int]) -> None:
        self.precision.unscale_gradients(optimizer)
        require_engine(self._engine).clip_grad_value_(float(clip_val), params=list(self.precision.main_params(optimizer)))

    # -- collectives --------------------------------------------------------------------------------

    def all_reduce(self, tensor: Tensor, group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Tensor:
        return self._reduce_tensor(tensor, group, reduce_op)

    # -- checkpoints ------------------------------------------------------------------------------

    @in_phase("fabric.save", FABRIC_SAVE_FIX)
    def save_checkpoint(self, path: Union[str, Path], state: dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:  # fmt: skip
        """Every rank calls it. ``state``'s model and optimizers are written sharded or full (see the module's
        docstring); everything else goes in as it is (objects with a ``state_dict``, their state dict)."""
        if storage_options is not None:
            raise TypeError("zero3: `fabric.save` takes no storage options: zero3 writes its checkpoints itself.")
        path = Path(self.broadcast(str(path)))
        if self._engine is None:  # nothing sharded yet: Fabric's own single file, from rank 0
            if self.is_global_zero:
                save_file_atomically(self._convert_stateful_objects_in_state(state, filter or {}), path)
            return
        model_key, optimizer_keys, extra = self._split_state(state, filter or {})
        optimizers = [state[key] for key in optimizer_keys]
        if self.config.checkpoint_format == "sharded":
            if filter:
                raise TypeError(
                    "zero3: `fabric.save(..., filter=...)` needs `checkpoint_format='full'`: a sharded checkpoint "
                    "holds whole shards (as torch FSDP's sharded state dicts, which refuse filters too)."
                )
            save_sharded_checkpoint(path, self._engine, optimizers, extra)
        else:  # rank 0 writes, unit by unit; its outcome reaches every rank
            keep = (filter or {}).get(model_key)
            save_full_checkpoint(path, self._engine, optimizers, extra, model_key, optimizer_keys, keep)

    def _split_state(self, state: dict[str, Any], filter: Optional[dict] = None) -> tuple[str, list[str], dict[str, Any]]:
        """The key of the sharded model, the keys of its optimizers, and the rest, made savable (with
        ``filter`` applied to the rest as Fabric applies it; the model's filter is the writer's)."""
        models = [key for key, value in state.items() if isinstance(value, nn.Module)]
        sharded = [key for key in models if self._owns(state[key])]
        if len(models) != 1 or len(sharded) != 1:
            raise ValueError(
                f"zero3: a checkpoint of a sharded model holds that one model (found modules under {models}); "
                "save other modules' state dicts as plain values, or in a checkpoint of their own."
            )
        optimizer_keys = [key for key, value in state.items() if isinstance(value, Optimizer)]
        foreign = [key for key in optimizer_keys if state[key] not in require_engine(self._engine).optimizers]
        if foreign:
            raise ValueError(f"zero3: the optimizers under {foreign} were not set up with this model (`fabric.setup`).")
        filtered = [key for key in optimizer_keys if key in (filter or {})]
        if filtered:
            raise TypeError(f"zero3: `fabric.save(..., filter=...)` of optimizer state ({filtered}) is not supported.")
        extra: dict[str, Any] = {}
        for key, value in state.items():
            if key not in models and key not in optimizer_keys:
                _apply_filter(key, filter or {}, value.state_dict() if isinstance(value, _Stateful) else value, extra)
        return sharded[0], optimizer_keys, extra

    def _owns(self, module: nn.Module) -> bool:
        return self._engine is not None and (module is self._engine.module or engine_of(module) is self._engine)

    @in_phase("fabric.load", FABRIC_SAVE_FIX)
    def load_checkpoint(self, path: Union[str, Path], state: Optional[Any] = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:  # fmt: skip
        """Every rank calls it. Fills ``state``'s model and optimizers in place (straight into the shards) and
        its other entries from the checkpoint; returns what the checkpoint holds beyond ``state``."""
        path = Path(self.broadcast(str(path)))
        if isinstance(state, nn.Module) and self._owns(state):  # fabric.load_raw(path, model)
            load_pretrained(state, path, strict=strict)
            return {}
        if isinstance(state, Optimizer) and self._engine is not None and state in self._engine.optimizers:
            self._engine.load_full_optimizer_state(state, load_checked_file(path, self._engine.comm, weights_only))
            return {}
        if not state or self._engine is None or not isinstance(state, dict):
            if is_sharded_checkpoint(path):
                raise ValueError(
                    f"zero3: {path} is a sharded checkpoint: it loads into the model it was saved from; call "
                    "`fabric.load(path, {'model': model, 'optimizer': optimizer, ...})` after `fabric.setup`."
                )
            return super().load_checkpoint(path, state, strict, weights_only)
        model_key, optimizer_keys, _ = self._split_state(state)
        optimizers = [state[key] for key in optimizer_keys]
        if is_sharded_checkpoint(path):
            rest = load_sharded_checkpoint(path, self._engine, optimizers, strict, weights_only)
        else:
            rest = load_checked_file(path, self._engine.comm, weights_only)  # checked; slices taken, pages dropped
            missing = [key for key in [model_key, *optimizer_keys] if key not in rest]
            if missing:
                raise KeyError(f"zero3: {path} holds nothing under {missing}; it holds {sorted(rest)}.")
            self._engine.load_full_state_dict(rest.pop(model_key), strict=strict)
            for key, optimizer in zip(optimizer_keys, optimizers):
                self._engine.load_full_optimizer_state(optimizer, rest.pop(key))
        for key in [k for k in state if k != model_key and k not in optimizer_keys]:
            if key not in rest:
                if strict:
                    raise KeyError(f"zero3: {path} holds no {key!r} (it holds {sorted(rest)}); pass strict=False to skip it.")
                continue
            if isinstance(state[key], _Stateful):
                state[key].load_state_dict(rest.pop(key))
            else:
                state[key] = rest.pop(key)
        return rest

    # -- teardown ---------------------------------------------------------------------------------

    def teardown(self) -> None:
        self._stop_watchdog()
        if self._failed:
            self._drop_engine_after_failure()
        elif self._engine is not None:
            self._engine.residency.leave()
            self._engine.trim()
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_names(cls, strategy_registry)
