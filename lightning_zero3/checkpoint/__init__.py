"""Checkpoints to resume from: save, load (on any number of ranks), consolidate to one file.

    api.py          a sharded checkpoint directory: each rank writes and reads its own part
    sharded.py      what a rank contributes to one, and how it takes its part back
    dcp_io.py       torch.distributed.checkpoint with zero3's flat pieces, read without unpickling code
    atomic.py       directories that exist whole or not at all, their manifest
    files.py        single ``torch.save`` files written atomically, read weights-only
    full.py         ``checkpoint_format="full"``: the single file DDP saves, written unit by unit
    consolidate.py  ``zero3-consolidate``: a sharded checkpoint to one file of full weights
    verify.py       ``lightning-zero3 verify``: a checkpoint or export checked against its checksums

Weights for other tools (no optimizer, not for resuming) are ``export/``'s.
Imports: ``engine``, ``export`` (its file writers and the Hugging Face layout) and ``errors``.
"""

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
