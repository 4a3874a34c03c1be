"""Sharded checkpoints: save, load (on any number of ranks), consolidate to one file."""

from .api import (
    NonFiniteCheckpointError,
    load_sharded_checkpoint,
    load_trainer_state,
    save_sharded_checkpoint,
    write_sharded_checkpoint,
)
from .atomic import CheckpointError, is_sharded_checkpoint, read_manifest, remove_checkpoint
from .dcp_io import FlatPiece, UnsafeCheckpointError
from .sharded import CheckpointMismatchError, model_pieces, optimizer_pieces

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "FlatPiece",
    "NonFiniteCheckpointError",
    "UnsafeCheckpointError",
    "is_sharded_checkpoint",
    "load_sharded_checkpoint",
    "load_trainer_state",
    "model_pieces",
    "optimizer_pieces",
    "read_manifest",
    "remove_checkpoint",
    "save_sharded_checkpoint",
    "write_sharded_checkpoint",
]
