"""Tensors of the model that are made of several checkpoint tensors (or of part of one), read by range.

[Note: reading a fused slice]
A Hub checkpoint can hold a model tensor in pieces: Mixtral's file has ``experts.N.w1`` and
``experts.N.w3`` (``[I, H]`` each) where the model has ``experts.gate_up_proj [E, 2I, H]``, built by
``torch.stack`` over the experts (dim 0), then ``torch.cat`` of the two stacks (dim 1). Along ``dim`` a
joined tensor of shape ``[*outer, D, *inner]`` is, in row-major order, ``outer`` repetitions of one block
per piece, piece ``c`` contributing ``n_c * inner`` contiguous elements that are elements
``[o * n_c * inner, (o + 1) * n_c * inner)`` of piece ``c`` flattened. So any element range of the joined
tensor (this rank's piece of its flat shard) is a short list of element ranges of the pieces, each one
contiguous range of bytes of one file tensor: ``Joined.read`` hands each on, and a rank reads exactly
the rows of ``w1[e]`` / ``w3[e]`` its shard holds (the same bytes ``safe_open(...).get_slice(name)[j0:j1]``
would read), never the whole tensors. A stack is a join of pieces seen with a size-1 dimension inserted.
A part of one tensor along ``dim`` (``Chunk``: a fused file tensor split into several model tensors) is
the same arithmetic the other way round (``Part``).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch


class Joined:
    """``torch.cat(pieces, dim)`` (or ``torch.stack`` with ``stack=True``) as a ``TensorSource``."""

    def __init__(self, pieces: Sequence[Any], dim: int, label: str, stack: bool = False) -> None:
        shapes = [list(p.shape) for p in pieces]
        if stack:
            shapes = [s[:dim] + [1] + s[dim:] for s in shapes]
        first = shapes[0]
        if dim < 0:
            dim += len(first)
        for shape in shapes[1:]:
            if len(shape) != len(first) or shape[:dim] + shape[dim + 1 :] != first[:dim] + first[dim + 1 :]:
                raise ValueError(f"cannot join {label}: the pieces' shapes {[list(p.shape) for p in pieces]} differ "
                                 f"outside dimension {dim}")  # fmt: skip
        self.pieces = list(pieces)
        self.sizes = [s[dim] for s in shapes]
        self.inner = math.prod(first[dim + 1 :])
        self.shape = torch.Size(first[:dim] + [sum(self.sizes)] + first[dim + 1 :])
        self.label = label

    def read(self, start: int, out: torch.Tensor) -> None:
        flat, end = out.view(-1), start + out.numel()
        row = sum(self.sizes) * self.inner  # elements of one outer repetition
        for outer in range(start // row, -(-end // row) if row else 0):
            at = outer * row
            for piece, size in zip(self.pieces, self.sizes):
                block = size * self.inner
                lo, hi = max(start, at), min(end, at + block)
                if lo < hi:
                    piece.read(outer * block + (lo - at), flat[lo - start : hi - start])
                at += block

    def release(self) -> None:
        for piece in self.pieces:
            piece.release()


class Part:
    """Elements ``[first, first + size)`` of ``whole`` along ``dim`` (a ``Chunk`` of a fused tensor)."""

    def __init__(self, whole: Any, dim: int, first: int, size: int, label: str) -> None:
        shape = list(whole.shape)
        if dim < 0:
            dim += len(shape)
        self.whole, self.first, self.size, self.total = whole, first, size, shape[dim]
        self.inner = math.prod(shape[dim + 1 :])
        self.shape = torch.Size(shape[:dim] + [size] + shape[dim + 1 :])
        self.label = label

    def read(self, start: int, out: torch.Tensor) -> None:
        flat, end = out.view(-1), start + out.numel()
        row = self.size * self.inner
        for outer in range(start // row, -(-end // row) if row else 0):
            lo, hi = max(start, outer * row), min(end, (outer + 1) * row)
            source = outer * self.total * self.inner + self.first * self.inner + (lo - outer * row)
            self.whole.read(source, flat[lo - start : hi - start])

    def release(self) -> None:
        self.whole.release()
