"""Pretrained checkpoints into zero3 models: each rank reads only its own shards (see ``load.py``)."""

from .load import PeerLoadError, load_pretrained
from .matching import CheckpointMismatchError
from .tensor_files import CheckpointFileError

__all__ = ["CheckpointFileError", "CheckpointMismatchError", "PeerLoadError", "load_pretrained"]
