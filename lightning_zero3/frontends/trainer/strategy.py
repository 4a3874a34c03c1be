"""``Zero3Strategy``: the Lightning glue around ``Zero3Engine``.

Lightning owns the loops, the launcher (one process per device, started by Lightning's subprocess
launcher or by torchrun / SLURM through its cluster environments) and the process group. This class
only decides *when* the engine shards the model, which optimizer it rebuilds, and what a checkpoint
holds. Everything ZeRO-3 itself does lives in ``engine/``.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Generator, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn

from ...config.knobs import DEFAULTS, build_config, knob_docstring
from ...config.settings import Zero3Config
from ...engine import Zero3Engine, engine_of
from ...engine.layout.materialize import move_real_tensors
from ...errors import Zero3ConfigError
from ...export.full_weights import save_full_weights
from ..shared_setup import ProcessesMixin, built_on_meta, new_engine, refuse_untrainable, register_names
from .auto_plan import step_activations
from .checkpointing import CheckpointingMixin
from .phases import PhasesMixin
from .precision import Zero3Precision, check_device_supports, to_zero3_precision

log = logging.getLogger(__name__)


class _RootCall(nn.Module):
    """A thin wrapper whose ``forward`` calls the LightningModule.

    Lightning routes ``training_step`` & co. through the wrapper's ``forward`` whenever the strategy's
    model is not the LightningModule itself; the call then passes the LightningModule's own
    ``__call__``, where the root unit's gather / release hooks sit.
    """

    def __init__(self, module: "pl.LightningModule") -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class Zero3Strategy(CheckpointingMixin, ProcessesMixin, PhasesMixin, ParallelStrategy):
    """ZeRO stage 3: parameters, gradients and optimizer states partitioned across data-parallel ranks.

    ``Trainer(strategy="zero3")`` after ``import lightning_zero3``, or ``Trainer(strategy=Zero3Strategy(...))``
    with any knob of :class:`~lightning_zero3.config.settings.Zero3Config` as a keyword argument (or ``config=``).
    """

    strategy_name = "zero3"

    def __init__(
        self,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        config: Optional[Zero3Config] = None,
        deepspeed_config: Optional[Union[str, dict]] = None,
        *,
        # [Note: one list of knobs] in config/knobs.py: one keyword per Zero3Config field, defaults from it
        persistence_threshold: int = DEFAULTS.persistence_threshold,
        unit_modules: Optional[Union[str, list[Union[type, str]], Callable[[nn.Module], bool]]] = DEFAULTS.unit_modules,
        prefetch_bucket_size: int = DEFAULTS.prefetch_bucket_size,
        max_live_parameters: int = DEFAULTS.max_live_parameters,
        max_reuse_distance: int = DEFAULTS.max_reuse_distance,
        reduce_bucket_size: int = DEFAULTS.reduce_bucket_size,
        overlap_comm: bool = DEFAULTS.overlap_comm,
        tune_collectives: bool = DEFAULTS.tune_collectives,
        single_process_sharding: bool = DEFAULTS.single_process_sharding,
        secondary_shard_size: Optional[Union[int, Literal["node"]]] = DEFAULTS.secondary_shard_size,
        quantize_gathers: Optional[Literal["int8"]] = DEFAULTS.quantize_gathers,
        cpu_threads: Optional[int] = DEFAULTS.cpu_threads,
        reduce_dtype: Optional[Literal["fp32", "bf16", "fp16"]] = DEFAULTS.reduce_dtype,
        sync_module_states: bool = DEFAULTS.sync_module_states,
        process_group_backend: Optional[Literal["gloo", "nccl", "mpi", "ucc", "xccl", "hccl"]] = (
            DEFAULTS.process_group_backend
        ),
        timeout: timedelta = DEFAULTS.timeout,
        hang_timeout: Optional[Union[timedelta, float]] = DEFAULTS.hang_timeout,
        hang_idle_timeout: Optional[Union[timedelta, float]] = DEFAULTS.hang_idle_timeout,
        inference_memory_budget: Optional[Union[int, str]] = DEFAULTS.inference_memory_budget,
        unshard_after_fit: bool = DEFAULTS.unshard_after_fit,
        checkpoint_format: Literal["sharded", "full"] = DEFAULTS.checkpoint_format,
        save_non_finite: bool = DEFAULTS.save_non_finite,
        offload_optimizer: Optional[Literal["cpu", "nvme", "none", "device", "auto"]] = DEFAULTS.offload_optimizer,
        offload_params: Optional[Literal["cpu", "nvme", "none", "device", "auto"]] = DEFAULTS.offload_params,
        memory_budget: Optional[Union[int, str]] = DEFAULTS.memory_budget,
        nvme_path: Optional[str] = DEFAULTS.nvme_path,
        offload_pin_memory: bool = DEFAULTS.offload_pin_memory,
        offload_buffer_count: int = DEFAULTS.offload_buffer_count,
        offload_buffer_size: int = DEFAULTS.offload_buffer_size,
        **misspelled: Any,
    ) -> None:
        knobs = {name: value for name, value in locals().items() if name in Zero3Config.field_names()}
        knobs.update(misspelled)  # unknown names fail in Zero3Config.from_kwargs, listing the valid ones
        # validate first: a bad knob fails before any process or model is touched
        self.config = build_config(config, deepspeed_config, knobs)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._num_nodes = 1
        self._engine: Optional[Zero3Engine] = None
        self._init_processes()

    # -- what Lightning looks up on a distributed strategy -----------------------------------------

    @property
    def is_distributed(self) -> bool:
        # Lightning injects the DistributedSampler and honours sync_dist only when this is True.
        return True

    @property
    def precision_plugin(self) -> Zero3Precision:
        if self._precision_plugin is None:
            self._precision_plugin = Zero3Precision()
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Optional[Precision]) -> None:
        # Lightning sets the plugin built from the `precision=` flag while constructing the Trainer, after
        # the accelerator: a flag zero3 cannot run here fails now, before any process starts.
        plugin = to_zero3_precision(precision_plugin)
        if plugin is not None:
            plugin.dtype_policy(self.config.reduce_dtype)
            check_device_supports(plugin, self._accelerator)
        self._precision_plugin = plugin

    # -- processes --------------------------------------------------------------------------------

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        self._start_processes()

    def _set_rank_zero_only(self, rank: int) -> None:
        rank_zero_only.rank = utils_rank_zero_only.rank = rank

    # -- model and optimizers ---------------------------------------------------------------------

    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._failed = False
        if fitting:
            refuse_untrainable(module, "call `trainer.validate`, `trainer.test` or `trainer.predict` instead of `trainer.fit`")
        precision = self.precision_plugin
        dtypes = precision.dtype_policy(self.config.reduce_dtype)
        engine = engine_of(module)
        if engine is None:
            precision.convert_module(module)
            self.model_to_device()
            # the automatic offload plan counts the job's activations, measured on the meta device
            activations = step_activations(trainer, module, self.config) if fitting else None
            engine = new_engine(module, self.config, self.root_device, dtypes, self.num_processes, activations)
        else:
            self._reuse(engine, dtypes)
        self._engine = engine
        self._plan_dynamic = fitting and engine.plan_estimate is not None
        self.model = _RootCall(module)
        precision.engine = engine
        precision.device_type = self.root_device.type
        if fitting:
            engine.detach_optimizers()  # an earlier fit's optimizers (and state) give way to this one's
            self.setup_optimizers(trainer)
            for optimizer in self.optimizers:
                engine.shard_optimizer(optimizer)
        self.setup_precision_plugin()

    def _reuse(self, engine: Zero3Engine, dtypes: Any) -> None:
        """The module is sharded already (an earlier fit, validate, ... ran): run on the same shards.

        [Note: sharded for the module's whole life]
        As with torch FSDP and DeepSpeed, the engine stays attached to the module when a Trainer call
        ends (see ``teardown``): evaluation after ``fit``, a second ``fit`` and checkpoints then run on the
        trained shards, with nothing rebuilt, gathered or broadcast. Only the settings that decide the
        layout of the shards must stay the same; scheduling settings (prefetch, buckets, overlap) follow
        the new Trainer's strategy."""
        problems = engine.reuse_problems(self.config, dtypes, self.root_device, self.world_size)
        if problems:
            raise Zero3ConfigError(
                "zero3: this model is already sharded by an earlier Trainer, with other settings than this one's: "
                + "; ".join(problems)
                + ". Use the same settings, or call `lightning_zero3.unshard(model)` on every rank first (it "
                "gathers the full model on every rank) so that this Trainer shards it anew."
            )
        engine.reconfigure(self.config)

    def model_to_device(self) -> None:
        assert self.lightning_module is not None
        # meta-device parameters stay where they are: the engine builds them as shards
        move_real_tensors(self.lightning_module, self.root_device)

    # -- sharded initialisation ([Note: sharded initialisation] in engine/layout/materialize.py) ------------

    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """``Trainer.init_module(empty_init=True)`` builds the model on the meta device; the engine then
        materialises it unit by unit, straight into shards."""
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        with built_on_meta(self.config, self.root_device), self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Parameters of modules built in ``configure_model`` go on the meta device (buffers are computed as
        usual, see [Note: only parameters on the meta device] in engine/layout/materialize.py); the engine
        materialises them unit by unit into shards, so no rank holds the full model. Their initial values
        come from a checkpoint (``load_pretrained``), else from the construction itself, replayed: the numbers an
        eager build (DDP's) draws after the same seed ([Note: eager construction replayed] in
        engine/layout/materialize.py). Only where construction did not set them: each module's ``reset_parameters()``,
        its library's initialiser and then the LightningModule's ``init_weights(module)``, if it has one."""
        with built_on_meta(self.config, self.root_device):
            yield

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        engine = self._engine
        if getattr(self, "_plan_dynamic", False) and engine is not None and engine.dynamic_plan is not None:
            # the automatic plan holds its budget: see [Note: the plan at step boundaries] in engine/plan/dynamic.py
            engine.dynamic_plan.step_boundary(self.lightning_module.trainer.global_step)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Optional[Any] = None, **kwargs: Any) -> Any:
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._report_grad_norm()
        return result

    def _report_grad_norm(self) -> None:
        """Log the global gradient norm that clipping by norm computed (``zero3/grad_norm``, through
        ``LightningModule.log``, so it reaches the Trainer's loggers at their cadence), and warn at the step
        where it is not finite (unless the fp16 loss scaler skipped that step, as it is made to)."""
        plugin = self.precision_plugin
        norm, plugin.grad_norm = plugin.grad_norm, None
        module = self.lightning_module
        if norm is None or module is None:
            return
        if not plugin.step_skipped and not bool(torch.isfinite(norm)):
            rank_zero_warn(
                f"zero3: the global gradient norm is {float(norm)} at step {module.trainer.global_step + 1}: the "
                "gradients hold NaN or inf, so this step's update is not finite either. Lower the learning rate, "
                "check the data of this step, or train in bf16 instead of fp16; a checkpoint of such a state is "
                "refused (see `Zero3Config.save_non_finite`)."
            )
        if module._current_fx_name is not None:  # inside a hook that may log
            module.log("zero3/grad_norm", norm.detach().float().reshape(()), on_step=True, on_epoch=False)

    @contextmanager
    def block_backward_sync(self) -> Generator:
        # Gradients are reduce-scattered after every backward, also while accumulating: each rank keeps
        # only its 1/N of the accumulated gradient. There is no "no_sync" to enter.
        yield None

    # -- collectives for Lightning (logging with sync_dist, early stopping, ...) ----------------------

    def reduce(
        self, tensor: Tensor, group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Tensor:
        return self._reduce_tensor(tensor, group, reduce_op)

    # -- teardown ---------------------------------------------------------------------------------

    def on_exception(self, exception: BaseException) -> None:
        self._note_exception(exception)

    def teardown(self) -> None:
        self._stop_watchdog()  # before the process may end (see Watchdog.stop)
        engine = self._engine
        if isinstance(self.model, _RootCall):
            self.model = self.lightning_module
        module = self.lightning_module
        fitting = module is not None and module._trainer is not None and module.trainer.state.fn == TrainerFn.FITTING
        if self._failed:
            # The base teardown would move the module to CPU, reading every (released, or still meta: the
            # engine failed while being built) weight and hiding the real error behind ours, so it runs
            # with the module detached.
            self._drop_engine_after_failure()
            if self._precision_plugin is not None:
                self._precision_plugin.engine = None
            self._lightning_module = None
            try:
                super().teardown()
            finally:
                self._lightning_module = module
            return
        if engine is not None and fitting and self.config.unshard_after_fit:
            self._engine = None
            engine.close()  # a collective: the LightningModule holds ordinary full weights again
            super().teardown()
            return
        if engine is None:
            super().teardown()
            return
        # [Note: sharded for the module's whole life] in ``_reuse``: the engine stays attached, the
        # module and its optimizer stay sharded where they are (on the device), as torch FSDP leaves them.
        engine.residency.leave()
        engine.trim()
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # -- evaluation stages: see engine/schedule/residency.py -----------------------------------------------------

    def on_validation_start(self) -> None:
        self._evaluation(start=True)

    def on_validation_end(self) -> None:
        self._evaluation(start=False)

    def on_test_start(self) -> None:
        self._evaluation(start=True)

    def on_test_end(self) -> None:
        self._evaluation(start=False)

    def on_predict_start(self) -> None:
        self._evaluation(start=True)

    def on_predict_end(self) -> None:
        self._evaluation(start=False)

    def _evaluation(self, start: bool) -> None:
        """Units may stay gathered across the stage's forward calls; leaving it releases them."""
        if self._engine is not None:
            if start:
                self._engine.residency.enter(stage=True)
            else:
                self._engine.residency.leave()

    # -- full weights, on request ------------------------------------------------------------------

    def save_full_weights(self, path: Union[str, "os.PathLike[str]"], prefix: str = "", fmt: Optional[str] = None) -> Path:
        """Write the full weights of the LightningModule to ``path`` (``.pt`` or ``.safetensors``), streamed
        unit by unit (a collective: call it on every rank; rank 0 writes). See ``save_full_weights``."""
        assert self.lightning_module is not None
        return save_full_weights(self.lightning_module, path, prefix=prefix, fmt=fmt)

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_names(cls, strategy_registry)


Zero3Strategy.__init__.__doc__ = knob_docstring(
    """Set up ZeRO stage 3; every setting is validated here, before any process starts.""",
    {
        "accelerator": "Set by the Trainer from its `accelerator` flag.",
        "parallel_devices": "Set by the Trainer from its `devices` flag.",
        "cluster_environment": "Set by the Trainer (local, torchrun, SLURM, ...).",
        "checkpoint_io": "How checkpoint files are written; the Trainer's default when None.",
        "precision_plugin": "Set by the Trainer from its `precision` flag.",
        "config": "A Zero3Config to start from; keywords that differ from their default override it.",
        "deepspeed_config": "A DeepSpeed config (dict or JSON file path; its `zero_optimization` block, or "
        "the block itself) translated knob by knob; keywords that differ from their default override it.",
    },
)
