"""Pretrained checkpoints into zero3 models: each rank reads only its own shards (see ``load.py``)."""

from .build import from_pretrained
from .load import PeerLoadError, load_pretrained

__all__ = ["PeerLoadError", "from_pretrained", "load_pretrained"]
