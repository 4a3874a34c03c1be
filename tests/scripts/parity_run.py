"""Train the example GPT under several strategies and variants; write per-step losses and final weights.

Run as a script (Lightning's launcher re-runs it once per rank):

    python tests/scripts/parity_run.py --devices 2 --out DIR --variants base,accum --strategies zero3,ddp

For every (strategy, variant) pair, rank 0 writes ``DIR/<strategy>-<variant>.pt`` holding the mean loss
over ranks at every optimizer step, the weights at the start of training and at the end, the random
generator's state at the start, and zero3's byte report. ``tests/frontends/test_parity.py`` compares them.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from gpt import GPTConfig, GPTModule, random_tokens  # noqa: E402

import lightning_zero3  # noqa: E402  (registers "zero3")

STEPS = 10
BATCH = 4


class StepLosses(pl.Callback):
    """Mean loss over ranks at every training batch, every rank's compute threads while it trains, and
    zero3's byte report at the end."""

    def __init__(self, keep_start: bool = False) -> None:
        self.keep_start = keep_start  # gathering the starting weights adds collectives: only where compared
        self.losses: list[float] = []
        self.memory: dict = {}
        self.start: dict = {}
        self.rng = None
        self.threads: list[int] = []

    def on_train_start(self, trainer, pl_module) -> None:
        if not self.keep_start:
            return
        engine = getattr(trainer.strategy, "engine", None)  # zero3's full weights: gathered on every rank
        weights = engine.full_state_dict() if engine is not None else pl_module.state_dict()
        self.start = {k: v.detach().clone() for k, v in weights.items()}
        self.rng = torch.get_rng_state()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach().clone()
        self.losses.append(float(trainer.strategy.reduce(loss, reduce_op="mean")))
        if batch_idx == 0:
            self.threads = [None] * trainer.world_size
            torch.distributed.all_gather_object(self.threads, torch.get_num_threads())

    def on_train_end(self, trainer, pl_module) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            stats = engine.comm.stats
            io = engine.offload.io if engine.offload is not None else None
            self.memory = {
                "report": engine.memory_report(),
                "swap_io": {"read": io.stats.read_bytes, "written": io.stats.write_bytes} if io else None,
                "units": engine.unit_sizes(),
                "comm_bytes": {kind: stats[kind].bytes for kind in stats},
            }


class FrozenGPT(GPTModule):
    """Position embedding and the first block frozen."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.model.wpe.weight.requires_grad_(False)
        for p in self.model.blocks[0].parameters():
            p.requires_grad_(False)


class ScheduledGPT(GPTModule):
    """AdamW with parameter groups plus a per-step LR schedule."""

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class SGDGPT(GPTModule):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


# variant -> (module factory, Trainer keyword arguments)
VARIANTS = {
    "base": (lambda cfg: GPTModule(cfg), {}),
    "accum": (lambda cfg: GPTModule(cfg), {"accumulate_grad_batches": 2}),
    "clip_norm": (lambda cfg: GPTModule(cfg), {"gradient_clip_val": 0.05}),
    "clip_value": (lambda cfg: GPTModule(cfg), {"gradient_clip_val": 0.001, "gradient_clip_algorithm": "value"}),
    "untied": (lambda cfg: GPTModule(GPTConfig(**{**cfg.__dict__, "tie_embeddings": False})), {}),
    "frozen": (lambda cfg: FrozenGPT(cfg), {}),
    "checkpointing": (lambda cfg: GPTModule(GPTConfig(**{**cfg.__dict__, "activation_checkpointing": True})), {}),
    "scheduler": (lambda cfg: ScheduledGPT(cfg), {}),
    "sgd": (lambda cfg: SGDGPT(cfg), {}),
    # built in configure_model: on the meta device under zero3, eagerly under DDP, from the same seed
    "sharded_init": (lambda cfg: GPTModule(cfg, sharded_init=True), {}),
    "fp32_20": (lambda cfg: GPTModule(cfg), {"max_steps": 20}),  # the fp32 twin of the bf16 runs
    "bf16": (lambda cfg: GPTModule(cfg), {"precision": "bf16-mixed", "max_steps": 20}),
    "bf16_reduce_bf16": (lambda cfg: GPTModule(cfg), {"precision": "bf16-mixed", "max_steps": 20}),
    "bf16_true": (lambda cfg: GPTModule(cfg), {"precision": "bf16-true", "max_steps": 20}),
    "unshard_threads": (lambda cfg: GPTModule(cfg), {}),
    "nvme_chunks": (lambda cfg: GPTModule(cfg), {}),
}
# zero3 knobs per variant (DDP has no equivalent)
ZERO3_KNOBS = {
    "bf16_reduce_bf16": {"reduce_dtype": "bf16"},
    # more compute threads than this machine gives a rank by default (its cores at most): the setting shows
    "unshard_threads": {"unshard_after_fit": True, "cpu_threads": len(os.sched_getaffinity(0)) + 1},
    # 4096 elements (16 KiB) per NVMe request: every shard of this model's units is read and written in pieces
    "nvme_chunks": {"offload_optimizer": "nvme", "offload_params": "nvme", "offload_buffer_size": 4096},
}
# variants of zero3 settings that train "base" as it is: zero3 alone runs them, compared with DDP's "base"
ZERO3_ONLY = {"unshard_threads": "base", "nvme_chunks": "base"}
# the offload strategies: the knobs of their registered names ("nvme" swaps under OUT/nvme)
OFFLOAD = {
    "zero3_offload": {"offload_optimizer": "cpu", "offload_params": "cpu"},
    "zero3_offload_nvme": {"offload_optimizer": "nvme", "offload_params": "nvme"},
}


def strategy_for(name: str, variant: str, threshold: int, out: Path):
    if name.startswith("zero3"):
        knobs = {**ZERO3_KNOBS.get(variant, {}), **OFFLOAD.get(name, {})}
        if "nvme" in knobs.values() and "nvme_path" not in knobs:
            knobs["nvme_path"] = str(out / "nvme")
        return lightning_zero3.Zero3Strategy(persistence_threshold=threshold, **knobs)
    return name


class CountedRequests:
    """Every NVMe read and write request of ``engine/offload/aio.py`` (bytes, the piece size asked for) and
    every piece of it that reached the file (``os.pwrite`` / ``os.preadv`` calls and their bytes), counted
    on the I/O threads that issue them."""

    def __init__(self) -> None:
        from lightning_zero3.engine.offload import aio

        self.lock, self.aio = threading.Lock(), aio
        self.requests = {"write": [], "read": []}  # (bytes, chunk bytes) per request
        self.pieces = {"write": [], "read": []}  # bytes per system call
        self._saved = aio.write_range, aio.read_range, aio.os
        counted = self

        class CountingOs:  # ``aio``'s view of ``os``: the two calls counted, the rest as they are
            def __getattr__(self, name):
                return getattr(os, name)

            @staticmethod
            def pwrite(fd, data, offset):
                done = os.pwrite(fd, data, offset)
                with counted.lock:
                    counted.pieces["write"].append(done)
                return done

            @staticmethod
            def preadv(fd, buffers, offset):
                got = os.preadv(fd, buffers, offset)
                with counted.lock:
                    counted.pieces["read"].append(got)
                return got

        def request(kind, function):
            def counted_request(swap, tensor, offset, chunk_bytes=1 << 26):
                with counted.lock:
                    counted.requests[kind].append((tensor.numel() * tensor.element_size(), chunk_bytes))
                return function(swap, tensor, offset, chunk_bytes)

            return counted_request

        aio.write_range, aio.read_range = request("write", aio.write_range), request("read", aio.read_range)
        aio.os = CountingOs()

    def close(self) -> dict:
        self.aio.write_range, self.aio.read_range, self.aio.os = self._saved
        return {"requests": self.requests, "pieces": self.pieces}


def run(strategy: str, variant: str, devices: int, out: Path, threshold: int) -> None:
    factory, trainer_kwargs = VARIANTS[variant]
    trainer_kwargs = dict(trainer_kwargs)
    steps = trainer_kwargs.pop("max_steps", STEPS)
    cfg = GPTConfig(vocab_size=128, block_size=32, n_layer=3, n_head=4, n_embd=64)
    pl.seed_everything(1234, workers=True)
    model = factory(cfg)
    accumulate = trainer_kwargs.get("accumulate_grad_batches", 1)
    data = random_tokens(steps * accumulate * BATCH * devices, cfg.block_size, cfg.vocab_size, seed=7)
    record = StepLosses(keep_start=variant == "sharded_init")
    requests = CountedRequests() if variant == "nvme_chunks" else None
    trainer = pl.Trainer(
        strategy=strategy_for(strategy, variant, threshold, out),
        accelerator="cpu",
        devices=devices,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record],
        deterministic=True,
        **trainer_kwargs,
    )
    trainer.fit(model, DataLoader(data, batch_size=BATCH, shuffle=False))
    io = requests.close() if requests is not None else None
    engine = lightning_zero3.engine_of(model)  # zero3 stays sharded after fit: the masters, gathered
    weights = engine.full_state_dict() if engine is not None else model.state_dict()
    weights = {k: v.detach().clone() for k, v in weights.items()}
    result = {"losses": record.losses, "weights": weights, "memory": record.memory, "threads": record.threads,
              "engine_after_fit": engine is not None, "io": io, "start": record.start, "rng": record.rng}  # fmt: skip
    if engine is not None and variant == "base":  # the public unshard(): full weights, the engine let go
        lightning_zero3.unshard(model)
        result["unsharded"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        result["engine_after_unshard"] = lightning_zero3.engine_of(model) is not None
    if trainer.is_global_zero:
        torch.save(result, out / f"{strategy}-{variant}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variants", default="base")
    parser.add_argument("--strategies", default="zero3,ddp")
    parser.add_argument("--persistence-threshold", type=int, default=1000)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for variant in args.variants.split(","):
        for strategy in args.strategies.split(","):
            if variant in ZERO3_ONLY and not strategy.startswith("zero3"):
                continue  # compared with this strategy's run of ZERO3_ONLY[variant]
            run(strategy, variant, args.devices, args.out, args.persistence_threshold)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
