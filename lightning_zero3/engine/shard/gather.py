"""How a unit's all-gather travels: from which shard, over which process group, in which encoding.

[Note: gather routes]
A unit is all-gathered over one of two *routes*:
- primary: every rank's shard (1/world of the unit) over the job's group;
- secondary: every rank's secondary shard (1/s of the unit, kept after its forward: see [Note: secondary
  shards] in secondary.py) over the rank's group of s ranks. Taken whenever the secondary shard is valid.
and in one of two *encodings*:
- the compute dtype;
- int8 blocks with fp32 scales (``quantize_gathers="int8"``, see [Note: int8 gathers] in engine/comm/quantize.py),
  on the primary route only: a secondary shard already holds the (dequantized) values forward used and
  is sent as it is, so backward sees exactly the weights forward saw; quantizing it again, with block
  boundaries of its own, would not give them back. Inside a node the bytes are cheap anyway.
  The persistent group (small parameters, gathered after each optimizer step) is never quantized: it is
  small by definition, and holds the biases and norm weights that quantization would hurt most.

A single unit in the compute dtype is gathered straight into its full buffer. Otherwise each rank packs
its *payloads* (its piece of each unit, encoded) side by side into one staging buffer; the all-gather
lands them rank-major (row r: rank r's payloads, see [Note: coalesced all-gather] in engine/schedule/gathers.py), and
once it completes each unit's column of payloads is decoded into its full buffer. Small units gathered
at one time share one all-gather per route (int8 units are packed side by side too, each with its own
blocks). Staging buffers come from the engine's pool.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Protocol

import torch

from ..comm.communicator import Communicator
from ..comm.quantize import decode_int8, encode_int8, padded, payload_bytes
from ..comm.records import Pending
from ..memory.buffers import BufferPool


class Gathered(Protocol):
    """What an all-gather reads and sets of a unit's flat group (``flat_group.FlatGroup`` is the one
    implementation; named here so that this file imports nothing above it)."""

    comm: Communicator
    full: torch.Tensor
    shard_numel: int
    dtype: torch.dtype
    compute_dtype: torch.dtype
    quantized: bool
    secondary: Optional[Any]  # a ``secondary.SecondaryShard`` while backward may gather inside the node
    pool: BufferPool
    gathers: int
    pending: Optional[Any]  # what completes the gather in flight (a ``Then``, or a ``CheckedAhead``)

    def gather_input(self) -> torch.Tensor: ...
    def begin_fill(self) -> None: ...
    def after_gather(self) -> None: ...


class Route(NamedTuple):
    over: str  # the Communicator's group: "job" (primary shards) or "secondary"
    quantized: bool  # int8 blocks (primary route only)


def route_of(group: Gathered) -> Route:
    """How ``group`` is gathered now (see [Note: gather routes])."""
    if group.secondary is not None and group.secondary.valid:
        return Route("secondary", False)
    return Route("job", group.quantized)


def _width(group: Gathered, route: Route) -> int:
    """Elements of the unit one rank sends on ``route``."""
    return group.secondary.width if route.over == "secondary" else group.shard_numel


def issue(groups: list[Gathered]) -> None:
    """Issue one all-gather for ``groups`` (the same route for each, in the same order on every rank)
    without waiting; each group's ``pending`` completes it (and decodes it into ``full``)."""
    route = route_of(groups[0])
    for group in groups:
        group.gathers += 1
        group.begin_fill()
    if len(groups) == 1 and not route.quantized:
        _issue_direct(groups[0], route)
    else:
        _issue_staged(groups, route)


def _issue_direct(group: Gathered, route: Route) -> None:
    """One unit in the compute dtype: straight into ``full``."""
    pool, give_back = group.pool, []
    with torch.no_grad():
        if route.over == "secondary":
            source = group.secondary.buffer
        else:
            source = group.gather_input()
            if group.compute_dtype != group.dtype:
                staged = pool.take(source.numel(), group.compute_dtype, source.device)
                staged.copy_(source)
                source = staged
                give_back.append(staged)
        pending = group.comm.all_gather(group.full, source, async_op=True, over=route.over)
    group.pending = Then(pending, lambda: [pool.give(buffer) for buffer in give_back])


def _issue_staged(groups: list[Gathered], route: Route) -> None:
    """Payloads packed side by side, gathered into a landing buffer, decoded into each ``full``."""
    first = groups[0]
    comm, pool, device = first.comm, first.pool, first.full.device
    ranks = comm.group_size(route.over)
    widths = [_width(g, route) for g in groups]
    if route.quantized:
        dtype, sizes = torch.uint8, [payload_bytes(w) for w in widths]
    else:
        dtype, sizes = first.compute_dtype, widths
    total = sum(sizes)
    with torch.no_grad():
        source = pool.take(total, dtype, device)
        offset = 0
        for group, width, size in zip(groups, widths, sizes):
            piece = source[offset : offset + size]
            if route.over == "secondary":
                piece.copy_(group.secondary.buffer)
            elif route.quantized:
                scratch = pool.take(padded(width), torch.float32, device)
                encode_int8(group.gather_input(), piece, scratch)
                pool.give(scratch)
            else:
                piece.copy_(group.gather_input())
            if route.over == "job":
                group.after_gather()  # the packed copy is what the collective reads
            offset += size
        landing = pool.take(ranks * total, dtype, device)
        pending = comm.all_gather(landing, source, async_op=True, over=route.over)

    def decode() -> None:
        rows = landing.view(ranks, total)
        offset = 0
        for group, width, size in zip(groups, widths, sizes):
            columns, out = rows[:, offset : offset + size], group.full.view(ranks, width)
            if route.quantized:
                scratch = pool.take(padded(width), torch.float32, device)
                decode_int8(columns, out, scratch)
                pool.give(scratch)
            else:
                out.copy_(columns)
            offset += size
        pool.give(landing)
        pool.give(source)

    shared = Then(pending, decode)
    for group in groups:
        group.pending = shared


class Then:
    """A pending collective followed, once, by a finishing step (shared by the groups it serves)."""

    def __init__(self, pending: Pending, then: Callable[[], object]) -> None:
        self._pending, self._then, self.done = pending, then, False

    def issue(self) -> None:
        """Issued already (a gather agreed on ahead is a ``CheckedAhead`` until issued, see comm/agreement.py)."""

    def wait(self) -> None:
        if not self.done:
            self._pending.wait()
            with torch.no_grad():
                self._then()
            self.done = True

    def ready(self) -> bool:
        return self.done or self._pending.ready()
