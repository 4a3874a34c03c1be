"""Block-wise int8 quantization of parameter shards for all-gathers (ZeRO++ qwZ).

[Note: int8 gathers]
A rank's piece of a unit (its shard, ``width`` elements) is cut into blocks of ``BLOCK`` elements; each
block is sent as int8 values and one fp32 scale (symmetric: ``scale = max|x| / 127``,
``q = round(x / scale)``), and every rank dequantizes what it receives into the unit's full buffer in
the compute dtype: ``x' = q * scale``. One rank's message (its *payload*) is ``[scales | q]``: 4 bytes
per block, then the int8 values, the last block padded with zeros, so the payload is a multiple of 4
bytes and the scales of every payload in a row of payloads stay 4-byte aligned (they are read in place).
Bytes on the wire per element: (4 + BLOCK) / BLOCK = 1.016 at 256, against 4 for fp32 (0.254x) and 2
for bf16 (0.508x); a shard of fewer than a few blocks pays more for its padding.

The error of one element is at most half a quantization step of its block, ``max|x| / 254`` (a block
that is all zeros gets scale 1, and its values stay exactly zero). Only the gathered copy is quantized:
masters, gradients and optimizer state stay in full precision, and every gather quantizes the current
master afresh, so errors do not accumulate across steps. Quantizing is deterministic: the forward
gather and backward's re-gather of a unit yield the same values, so backward differentiates the weights
forward used.

Nothing here allocates a buffer of a unit's size: the caller passes an fp32 ``scratch`` of
``padded(width)`` elements (from the engine's staging pool).
"""

from __future__ import annotations

import torch

BLOCK = 256  # elements per scale


def padded(numel: int, block: int = BLOCK) -> int:
    """``numel`` rounded up to whole blocks."""
    return -(-numel // block) * block


def payload_bytes(width: int, block: int = BLOCK) -> int:
    """Bytes of one rank's payload for a piece of ``width`` elements: a scale and ``block`` int8 per block."""
    return padded(width, block) // block * (4 + block)


def _parts(payload: torch.Tensor, blocks: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales (fp32, ``blocks``) and the values (int8, ``blocks x block``) inside a uint8 payload."""
    scales = payload[: 4 * blocks].view(torch.float32)
    values = payload[4 * blocks : 4 * blocks + blocks * block].view(torch.int8).view(blocks, block)
    return scales, values


def encode_int8(x: torch.Tensor, payload: torch.Tensor, scratch: torch.Tensor, block: int = BLOCK) -> None:
    """Quantize the 1-D ``x`` into ``payload`` (uint8, ``payload_bytes(x.numel())``, 4-byte aligned), using
    ``scratch`` (fp32, ``padded(x.numel())`` elements; overwritten)."""
    n, blocks = x.numel(), padded(x.numel(), block) // block
    scratch[:n].copy_(x)
    scratch[n:].zero_()
    values = scratch.view(blocks, block)
    scales, q = _parts(payload, blocks, block)
    absmax = torch.maximum(values.amax(dim=1), values.amin(dim=1).neg_())  # no |x| copy of the piece
    torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax), out=scales)
    values.div_(scales.unsqueeze(1)).round_().clamp_(-127, 127)
    q.copy_(values)


def decode_int8(payloads: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor, block: int = BLOCK) -> None:
    """Dequantize row r of ``payloads`` (uint8, (n, payload_bytes(width)), rows 4-byte aligned) into row r of
    ``out`` ((n, width), any float dtype), using ``scratch`` (fp32, ``padded(width)``; overwritten)."""
    width = out.shape[1]
    blocks = padded(width, block) // block
    values = scratch.view(blocks, block)
    for row, target in zip(payloads, out):
        scales, q = _parts(row, blocks, block)
        values.copy_(q).mul_(scales.unsqueeze(1))
        target.copy_(scratch[:width])
