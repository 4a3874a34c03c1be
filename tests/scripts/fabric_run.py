"""Fabric loops under ``strategy="zero3"`` and ``"ddp"`` on 2 CPU ranks (Fabric's own launcher starts rank 1
by running this script again); each rank writes ``OUT/rank<R>.pt``.

Cases (every one run under both strategies from the same weights, except where said):
  clip     6 steps with ``fabric.clip_gradients(max_norm=...)``
  accum    4 steps of 2 micro-batches, the first under ``fabric.no_backward_sync``
  raw      the model built with ``init_module(empty_init=True)``, its weights from a plain
           ``torch.save(model.state_dict())`` file through ``fabric.load_raw``, then 3 steps
  seeded   ``seed_everything(0)`` and the model built with ``init_module(empty_init=True)`` (under
           DDP ``empty_init=False``: its empty init leaves the weights unset): the weights it starts
           from, the generator's state after ``setup``, then 3 steps
  hub      a tiny Mixtral saved as the Hub has it (per-expert tensors); zero3 builds it under
           ``init_module(empty_init=True)`` and ``load_pretrained`` (inside that block) reads each rank's
           slices into the fused experts, DDP (``find_unused_parameters``) loads it with ``from_pretrained``;
           the generator's state after the load, then 3 steps
  resume   zero3 only, per checkpoint format: 3 steps, ``fabric.save``, 3 more; then a new model and
           optimizer, ``fabric.load``, the same 3 steps again
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
from pathlib import Path

import torch
from lightning.fabric import Fabric

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from gpt import GPT, GPTConfig, random_tokens  # noqa: E402

import lightning_zero3  # noqa: E402

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
SMALL_UNITS = dict(persistence_threshold=1000)


def batches(rank: int, count: int):
    x, y = random_tokens(4 * count * 2, CFG.block_size, CFG.vocab_size).tensors
    return [(x[i : i + 4], y[i : i + 4]) for i in range(rank * 4, 4 * count * 2, 8)][:count]


def new_fabric(name: str, ddp: str = "ddp", **settings) -> Fabric:
    strategy = lightning_zero3.Zero3FabricStrategy(**{**SMALL_UNITS, **settings}) if name == "zero3" else ddp
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=2)
    fabric.launch()
    return fabric


def build(fabric: Fabric, seed: int = 0):
    fabric.seed_everything(seed)
    model = GPT(CFG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return fabric.setup(model, optimizer)


def step(fabric, model, optimizer, micro: list, clip: float | None = None) -> float:
    losses = []
    for index, (x, y) in enumerate(micro):
        with fabric.no_backward_sync(model, enabled=index < len(micro) - 1):
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)) / len(micro)
            fabric.backward(loss)
        losses.append(loss.item())
    if clip is not None:
        fabric.clip_gradients(model, optimizer, max_norm=clip)
    optimizer.step()
    optimizer.zero_grad()
    return sum(losses)


def run_clip(name: str) -> dict:
    fabric = new_fabric(name)
    model, optimizer = build(fabric)
    losses = [step(fabric, model, optimizer, [b], clip=0.05) for b in batches(fabric.global_rank, 6)]
    out = {"losses": losses}
    engine = getattr(fabric.strategy, "engine", None)
    if engine is not None:
        out["optimizer_state_bytes"] = engine.memory_report()["optimizer_state"]
        out["trainable_units"] = sum(1 for rt in engine.runtimes if rt.group.trainable)
    else:
        out["optimizer_state_bytes"] = sum(v.numel() * v.element_size() for s in optimizer.state.values()
                                           for v in s.values() if torch.is_tensor(v) and v.dim() > 0)  # fmt: skip
    return out


def run_accum(name: str) -> dict:
    fabric = new_fabric(name)
    model, optimizer = build(fabric)
    data = batches(fabric.global_rank, 8)
    return {"losses": [step(fabric, model, optimizer, data[i : i + 2]) for i in range(0, 8, 2)]}


def run_raw(name: str, out: Path) -> dict:
    fabric = new_fabric(name)
    rank = fabric.global_rank
    raw = out / "raw.pt"
    if rank == 0 and not raw.exists():
        torch.manual_seed(5)
        torch.save(GPT(CFG).state_dict(), raw)
    fabric.barrier()
    with fabric.init_module(empty_init=True):
        model = GPT(CFG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    fabric.load_raw(raw, model)
    return {"losses": [step(fabric, model, optimizer, [b]) for b in batches(rank, 3)]}


def run_seeded(name: str) -> dict:
    fabric = new_fabric(name)
    fabric.seed_everything(0)
    with fabric.init_module(empty_init=name == "zero3"):  # DDP's empty_init leaves the weights unset
        model = GPT(CFG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    rng = torch.get_rng_state()
    engine = getattr(fabric.strategy, "engine", None)  # zero3's full weights, gathered on every rank
    start = engine.full_state_dict() if engine is not None else model.state_dict()
    start = {k: v.detach().clone() for k, v in start.items()}
    losses = [step(fabric, model, optimizer, [b]) for b in batches(fabric.global_rank, 3)]
    return {"start": start, "rng": rng, "losses": losses}


def run_hub(name: str, out: Path) -> dict:
    import transformers as T
    from safetensors import safe_open

    fabric = new_fabric(name, ddp="ddp_find_unused_parameters_true")  # DDP: experts no token chose
    path = out / "mixtral"
    if fabric.global_rank == 0 and not path.exists():
        torch.manual_seed(0)
        T.MixtralForCausalLM(T.MixtralConfig(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
        )).save_pretrained(path)  # fmt: skip
    fabric.barrier()
    with safe_open(path / "model.safetensors", "pt") as file:
        per_expert = any(".experts.0.w1." in key for key in file.keys())
    fabric.seed_everything(3)
    if name == "zero3":  # loaded where it is built: nothing is drawn for the checkpoint's tensors
        with fabric.init_module(empty_init=True):
            model = T.AutoModelForCausalLM.from_config(T.AutoConfig.from_pretrained(path), dtype=torch.float32)
            lightning_zero3.load_pretrained(model, path)
    else:
        model = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    generator = torch.get_rng_state()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    losses = []
    for x, _ in batches(fabric.global_rank, 3):
        loss = model(input_ids=x, labels=x).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "per_expert_file": per_expert, "rng_after_load": generator}


def run_resume(fmt: str, out: Path) -> dict:
    fabric = new_fabric("zero3", checkpoint_format=fmt)
    data = batches(fabric.global_rank, 6)
    model, optimizer = build(fabric)
    first = [step(fabric, model, optimizer, [b]) for b in data[:3]]
    path = out / f"resume-{fmt}.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 3})
    straight = [step(fabric, model, optimizer, [b]) for b in data[3:]]
    fabric = new_fabric("zero3", checkpoint_format=fmt)
    model, optimizer = build(fabric, seed=1)  # other weights: the load must replace them all
    state = {"model": model, "optimizer": optimizer, "step": 0}
    rest = fabric.load(path, state)
    resumed = [step(fabric, model, optimizer, [b]) for b in data[3:]]
    return {"first": first, "straight": straight, "resumed": resumed, "step": state["step"], "rest": sorted(rest),
            "is_file": path.is_file()}  # fmt: skip


def record_exit(out: Path) -> None:
    """Registered before zero3's exit handler, so it runs after it: what zero3 left running at this
    process's exit (``OUT/exit-<pid>.json``). No Fabric of this script is torn down, as Fabric leaves them."""
    from lightning_zero3.engine.failure.process_exit import gloo_threads

    def record() -> None:
        watchdogs = [t.name for t in threading.enumerate() if t.name.startswith("zero3-watchdog")]
        (out / f"exit-{os.getpid()}.json").write_text(json.dumps({"watchdogs": watchdogs, "gloo_threads": gloo_threads()}))

    atexit.register(record)


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    record_exit(out)
    results: dict = {}
    for name in ("zero3", "ddp"):
        results[f"clip-{name}"] = run_clip(name)
        results[f"accum-{name}"] = run_accum(name)
        results[f"raw-{name}"] = run_raw(name, out)
        results[f"seeded-{name}"] = run_seeded(name)
        results[f"hub-{name}"] = run_hub(name, out)
    for fmt in ("sharded", "full"):
        results[f"resume-{fmt}"] = run_resume(fmt, out)
    # a full checkpoint is Fabric DDP's own file: DDP loads it
    fabric = new_fabric("ddp")
    model, optimizer = build(fabric, seed=1)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(out / "resume-full.ckpt", state)
    data = batches(fabric.global_rank, 6)[3:]
    results["full-into-ddp"] = {"losses": [step(fabric, model, optimizer, [b]) for b in data], "step": state["step"]}
    torch.save(results, out / f"rank{fabric.global_rank}.pt")


if __name__ == "__main__":
    main()
