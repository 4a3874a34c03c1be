"""Issuing the all-gathers of the units the schedule asks for: which are agreed on now or ahead, and which
small ones share one all-gather."""

from __future__ import annotations

from ..shard.flat_group import FlatGroup
from ..shard.gather import issue, route_of


def start_gathers(groups: list[FlatGroup], coalesce_below: int, first_needed: bool = True) -> None:
    """Issue the all-gathers of ``groups`` (in this order, the same on every rank) without waiting.
    ``groups[0]`` is needed at once unless ``first_needed`` is False (every group is gathered ahead).

    Groups smaller than ``coalesce_below`` elements share one all-gather (one per route, see
    [Note: gather routes] in engine/shard/gather.py).

    [Note: coalesced all-gather]
    An all-gather concatenates the ranks' inputs rank by rank. Each rank sends its shards of several
    groups side by side, so the output is rank-major, ``[g1 slice 0 | g2 slice 0 | ... | g1 slice 1 | ...]``;
    once it lands, each group's column block is copied into its own ``full`` buffer.

    [Note: gathers ahead do not wait for the disk]
    Issuing a gather reads its input, and under NVMe offload that waits for the shard's read from the
    disk. Gathered ahead while its read is still in flight, a unit would make the compute
    wait for the disk right where the read was issued instead of where the unit runs, so a token would
    take the compute plus the reading instead of the longer of the two. With
    one process the gather is the read itself (the shard is the gathered buffer), so such a unit is left
    to its own start, and the read runs behind the compute of the units before it. With several ranks
    every rank must issue the same gathers in the same order, and how far a read has got is this rank's
    own business, so there the gather ahead still waits for the read.

    [Note: a blocking check takes the gathers ahead along]
    Gathers ahead of need are agreed on at one start and issued at the next (see [Note: checks run a unit
    ahead] in engine/comm/agreement.py), so they lead the compute by one unit less than they were chosen for. Where
    the unit starting must be agreed on while everyone waits anyway (the first unit of a pass, a unit the
    prefetch missed), the gathers ahead join that check and are issued right after the needed one: no
    round trip more, and the first units prefetched in a pass lead by a whole unit (else the second block
    of each forward waits for a gather issued at its own start).
    """
    check = groups[0].check
    if check is not None:
        check.settle()  # gathers agreed on ahead go first: see [Note: checks run a unit ahead] in engine/comm/agreement.py
    needed = groups[:1] if first_needed else []
    ahead = [g for g in groups[len(needed) :] if not g.read_in_flight_alone()]
    # once each (a trace in which a unit repeats, a module called twice, may name it twice)
    waiting = list(dict.fromkeys(g for g in needed + ahead if g.pending is None and not g.gathered))
    if check is None or not check.checks_ahead:  # one process: nobody to agree with
        _issue_coalesced(waiting, coalesce_below)
        return
    now = [g for g in waiting if g in needed]  # needed at once: agreed on while everyone waits
    later = [g for g in waiting if g not in needed]  # ahead of need
    if now:
        check.check(now + later)  # [Note: a blocking check takes the gathers ahead along]
        _issue_coalesced(now, coalesce_below)
        _issue_coalesced(later, coalesce_below)
    elif later:  # agreed on now, issued at the next start
        check.check_ahead(later, lambda agreed: _issue_coalesced(agreed, coalesce_below))


def _issue_coalesced(waiting: list[FlatGroup], coalesce_below: int) -> None:
    """Issue the all-gathers of ``waiting``, the small groups on one route sharing one."""
    together: dict = {}  # route -> the small groups gathered on it, in order
    for group in waiting:
        if group.full.numel() < coalesce_below:
            together.setdefault(route_of(group), []).append(group)
    for group in waiting:
        batch = together.get(route_of(group), [])
        if group not in batch:
            issue([group])
        elif group is batch[0]:
            issue(batch)
