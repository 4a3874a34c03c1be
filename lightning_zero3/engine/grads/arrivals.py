"""Which trainable parameters of a group received a gradient in this backward, read when it is packed.

[Note: which parameters received a gradient]
A parameter that no rank used keeps ``.grad`` None, as under DDP (see [Note: which parameters had a
gradient] in reduction.py), so each rank must tell which of a group's parameters autograd gave a gradient.
A parameter whose ``.grad`` is its own tensor has one when it is not None. A landing view (see [Note:
gradients land in a pooled buffer] in engine/shard/flat_group.py) exists whether or not autograd wrote into it, and a
Python hook per parameter to say so was the costliest host work of a small model's step (148 hooks a
step on the 85M GPT's structure). Instead:
- autograd accumulates into an existing ``.grad`` in place, one ``add_`` per parameter per backward
  (however often the parameter was used), and every view of the landing buffer shares the buffer's
  version counter: so when the counter moved by exactly the number of landing views, every one of them
  received its gradient, which is every step of a model whose parameters all train (a user's in-place
  write into a landing ``.grad`` during backward, in the same backward as a parameter that got none,
  would hide that one: it would count as used, and get zeros instead of None if no rank used it);
- otherwise (an expert no token reached, a ``.grad`` replaced under ``create_graph``) each landed
  parameter is asked whether the running backward executes its gradient accumulator, which is the
  graph's reachability, as DDP's ``find_unused_parameters`` decides it. That needs the backward to be
  running, which is where every group is packed (its hooks, or the callback that ends it).
"""

from __future__ import annotations

import torch
from torch.autograd.graph import get_gradient_edge

from ..shard.flat_group import FlatGroup


def received_gradients(group: FlatGroup) -> list[bool]:
    """Per trainable slot of ``group``, whether it received a gradient in the running backward (every
    group is packed while it runs); read with the engine's access to released parameters (see
    ``released.engine_access``)."""
    slots = group.trainable_slots
    if group.landing is None:
        return [slot.param.grad is not None for slot in slots]
    landed = group.landed
    every = group.landing._version - group.landed_version == sum(landed)
    return [(every or _reached(slot.param)) if sets else slot.param.grad is not None for slot, sets in zip(slots, landed)]


def _reached(param: torch.Tensor) -> bool:
    """Whether the running backward executes ``param``'s gradient accumulator."""
    return torch._C._will_engine_execute_node(get_gradient_edge(param).node)
