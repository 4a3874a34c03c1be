"""Loading: pretrained checkpoints into zero3 models, each rank reading only its own shards.

    load.py          ``load_pretrained``: where it is called decides how (meta model or sharded model)
    matching.py      which checkpoint tensor goes into which model tensor, checked before any read
    conversions.py   a Hub checkpoint's names and layout into the model's, by transformers' own rules
    fused.py         model tensors made of several checkpoint tensors, read by range
    tensor_files.py  the tensors of safetensors / torch files and Hugging Face directories, by range
    reader.py        byte ranges of a file read into a staging buffer and handed on

The engine's side of loading: ``engine/layout/sources.py`` (what a unit's values come from: drawn,
given, or pending from a checkpoint) and ``engine/state/loading.py`` (a sharded model's pieces
overwritten in place).
Imports: ``engine``, ``checkpoint`` (its errors) and ``errors``; never Lightning.
"""

from .build import from_pretrained
from .load import PeerLoadError, load_pretrained

__all__ = ["PeerLoadError", "from_pretrained", "load_pretrained"]
