"""Pretrained checkpoints into zero3 models: each rank reads only its own shards (see ``load.py``)."""

from .load import PeerLoadError, load_pretrained

__all__ = ["PeerLoadError", "load_pretrained"]
