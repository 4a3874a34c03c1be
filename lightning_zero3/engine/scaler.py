"""Dynamic loss scaling for fp16 over sharded gradients.

The loss is multiplied by ``scale`` before backward so small fp16 gradients do not flush to zero. After
backward the shard gradients are divided by ``scale`` and checked for inf/NaN. Each rank sees only its
shard, so the "found inf" flag is all-reduced (max): every rank then skips the same step and moves the
scale the same way, and the scale stays identical everywhere. Same rules as ``torch.amp.GradScaler``:
halve on overflow, double after ``growth_interval`` clean steps.

[Note: one host read per step]
Asking "is this gradient finite?" of each shard in Python reads a device flag back to the host once per
shard: on CUDA, a sync per tensor, each one draining the stream. Instead the gradients are unscaled and
checked in groups of one device and dtype by ``torch._amp_foreach_non_finite_check_and_unscale_`` (the
kernel ``torch.amp.GradScaler`` uses, for CPU and CUDA), which raises a flag tensor on that device
without telling the host. The flags are folded into one tensor on the group's device, all-reduced, and
read once.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

import torch
import torch.distributed as dist

from .comm import Communicator


class ShardedLossScaler:
    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        if init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise ValueError(
                "zero3 loss scaler: need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and "
                f"growth_interval >= 1; got {init_scale}, {growth_factor}, {backoff_factor}, {growth_interval}."
            )
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.clean_steps = 0
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_and_check(self, params: Iterable[torch.Tensor], comm: Communicator) -> bool:
        """Divide the gradients by the scale; True when any rank found a non-finite gradient.
        See [Note: one host read per step]."""
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for p in params:
            if p.grad is not None and p.grad.numel():
                groups[(p.grad.device, p.grad.dtype)].append(p.grad)
        found = torch.zeros(1, device=comm.device)  # offloaded gradients sit on the host
        flags: dict[torch.device, torch.Tensor] = {}
        for (device, _dtype), grads in groups.items():
            if device not in flags:
                flags[device] = found if device == found.device else torch.zeros(1, device=device)
            inverse = torch.full((1,), 1.0 / self.scale, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flags[device], inverse)
        for flag in flags.values():
            if flag is not found:
                found += flag.to(found.device)
        comm.all_reduce(found, op=dist.ReduceOp.MAX)
        return bool(found.item())  # the step's one host read

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            self.skipped_steps += 1
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
