"""The checkpoint half of ``Zero3Strategy``: what a checkpoint holds, and writing and reading it.

Sharded (the default): each rank's pieces go straight to a checkpoint directory (see ``checkpoint/``);
full: one file of gathered state. Either loads after ``setup``, straight into the engine's shards.

A mixin that imports nothing of Lightning, so the ``pytorch_lightning`` flavour of the strategy (see
[Note: two Lightnings] in frontends/registration.py) shares it as it is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional, Union

from torch.optim import Optimizer

from ...checkpoint import (
    CheckpointMismatchError,
    is_sharded_checkpoint,
    load_sharded_checkpoint,
    model_pieces,
    optimizer_pieces,
    remove_checkpoint,
    save_sharded_checkpoint,
)
from ...checkpoint.files import load_file_checkpoint, save_file_atomically
from ...checkpoint.full import STREAMED, save_full_checkpoint
from ...engine.comm.collective_log import LOAD_FIX, SAVE_FIX, in_phase


def _unwrap(optimizer: Optimizer) -> Optimizer:
    """The torch optimizer inside Lightning's ``LightningOptimizer`` wrapper (or the optimizer itself)."""
    return getattr(optimizer, "_optimizer", optimizer)


class CheckpointingMixin:
    """Checkpoint methods of ``Zero3Strategy`` (``self`` is the strategy: ``_engine``, ``config``, ...)."""

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # checkpoints load into the shards, which exist once the engine is built

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # ``load_checkpoint`` restores the optimizers itself

    @property
    def _sharded_checkpoints(self) -> bool:
        return self._engine is not None and self.config.checkpoint_format == "sharded"

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Sharded: this rank's ``FlatPiece`` of each parameter (no copy). Full: the gathered weights under
        the module's own names, in the master dtype (a collective)."""
        module = self.lightning_module
        assert module is not None
        if self._engine is None:
            return module.state_dict()
        return model_pieces(self._engine) if self._sharded_checkpoints else {STREAMED: True}

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Sharded: this rank's part, keyed by parameter name. Full: the state an unsharded optimizer holds."""
        optimizer = _unwrap(optimizer)
        if self._engine is None:
            return optimizer.state_dict()
        if self._sharded_checkpoints:
            return optimizer_pieces(self._engine, optimizer)
        return {STREAMED: True}  # gathered and written unit by unit in ``save_checkpoint``

    @in_phase("Trainer.save_checkpoint", SAVE_FIX)
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Union[str, Path], storage_options: Optional[Any] = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "zero3: `save_checkpoint(..., storage_options=...)` is not supported: zero3 writes checkpoints "
                "itself (sharded directories, or atomic single files), not through a CheckpointIO plugin."
            )
        path = Path(self.broadcast(str(filepath)))
        if self._engine is None:
            if self.is_global_zero:
                save_file_atomically(checkpoint, path)
            return
        # The model and optimizer entries are made anew inside the save: sharded, this rank's pieces (under
        # NVMe read from the swap files as DCP writes them); full, gathered unit by unit as they are written.
        checkpoint.pop("state_dict")
        with_optimizers = checkpoint.pop("optimizer_states", None) is not None
        optimizers = [_unwrap(o) for o in self.optimizers] if with_optimizers else []
        if self._sharded_checkpoints:
            save_sharded_checkpoint(path, self._engine, optimizers, checkpoint)
        else:  # rank 0 writes; its outcome reaches every rank (see checkpoint/full.py)
            save_full_checkpoint(path, self._engine, optimizers, checkpoint)

    def remove_checkpoint(self, filepath: Union[str, Path]) -> None:
        if self.is_global_zero:
            remove_checkpoint(Path(filepath))

    @in_phase("loading a checkpoint", LOAD_FIX)
    def load_checkpoint(self, checkpoint_path: Union[str, Path], weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load a sharded directory or a full file into the engine; return the rest for Lightning.

        Loading is weights-only (no code in a checkpoint runs) unless ``weights_only=False`` is passed."""
        path = Path(self.broadcast(str(checkpoint_path)))
        module, engine = self.lightning_module, self._engine
        assert module is not None and engine is not None, "zero3 loads checkpoints after setup"
        fitting = module.trainer.state.fn == "fit"  # TrainerFn.FITTING, a str enum
        optimizers = [_unwrap(o) for o in self.optimizers] if fitting else []
        if is_sharded_checkpoint(path):
            return load_sharded_checkpoint(path, engine, optimizers, module.strict_loading, weights_only)
        checkpoint = load_file_checkpoint(path, engine.comm, weights_only)  # checked; slices taken, pages dropped
        engine.load_full_state_dict(checkpoint["state_dict"], strict=module.strict_loading)
        if optimizers:
            if "optimizer_states" not in checkpoint:
                raise CheckpointMismatchError(
                    f"zero3: {path} holds no optimizer state (was it saved with `save_weights_only=True`?), so "
                    "training cannot resume from it; load its weights with `trainer.fit(model)` after "
                    "`model.load_state_dict(...)`, or resume from a full checkpoint."
                )
            self.load_optimizer_state_dict(checkpoint)
        return checkpoint

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint["optimizer_states"]
        if len(states) != len(self.optimizers):
            raise ValueError(
                f"zero3: the checkpoint holds {len(states)} optimizer state(s) but `configure_optimizers` "
                f"returned {len(self.optimizers)}; resume with the optimizers the checkpoint was written with."
            )
        for optimizer, state in zip(self.optimizers, states):
            if self._engine is None:
                optimizer.load_state_dict(state)
            else:
                self._engine.load_full_optimizer_state(optimizer, state)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        module = self.lightning_module
        assert module is not None
        if self._engine is None:
            module.load_state_dict(checkpoint["state_dict"], strict=strict)
        # with an engine, ``load_checkpoint`` has already put the weights into the shards
