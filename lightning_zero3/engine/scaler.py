"""Dynamic loss scaling for fp16 over sharded gradients.

The loss is multiplied by ``scale`` before backward so small fp16 gradients do not flush to zero. After
backward the shard gradients are divided by ``scale`` and checked for inf/NaN. Each rank sees only its
shard, so the "found inf" flag is all-reduced (max): every rank then skips the same step and moves the
scale the same way, and the scale stays identical everywhere. Same rules as ``torch.amp.GradScaler``:
halve on overflow, double after ``growth_interval`` clean steps. Unscaling and the overflow check run
where the gradients live, with one host read per step (``gradients.unscale_gradients_``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import torch

if TYPE_CHECKING:
    from .engine import Zero3Engine


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

    def unscale_and_check(self, engine: "Zero3Engine", params: Iterable[torch.Tensor]) -> bool:
        """Divide the gradients of ``params`` (shard parameters) by the scale; True when any rank found a
        non-finite gradient (wherever the gradients live, see ``grads/gradients.py``)."""
        return engine.unscale_gradients_(1.0 / self.scale, params)

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
