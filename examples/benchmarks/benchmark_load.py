"""Loading a pretrained Hugging Face checkpoint into a sharded model: zero3 against its peers, per rank.

Question: How fast does a pretrained checkpoint load into zero3's shards, against FSDP2 and DeepSpeed, and with how much memory?

    python examples/benchmarks/benchmark_load.py                 # ~1B-parameter Llama, bf16 files, 4 ranks, 3 runs
    python examples/benchmarks/benchmark_load.py --quick         # a small model, 1 run (what the test runs)
    python examples/benchmarks/benchmark_load.py --family mixtral --quick   # a Mixtral (per-expert files)
    python examples/benchmarks/benchmark_load.py --family llava_next --quick   # a LLaVA-Next (Hub prefixes)

One checkpoint (``save_pretrained``: bf16 safetensors split into several files with an index, written
once under ``--dir``) is loaded into a model sharded over ``--ranks`` CPU processes with fp32 masters by:

  zero3            the model built from its config on the meta device and ``lightning_zero3.load_pretrained``
                   in the same block (as ``configure_model`` does), then ``Zero3Engine``: no random number
                   is drawn for the checkpoint's tensors, each rank copies only the byte ranges of its shards
  zero3_drawn      the same with ``load_pretrained`` called after the block that builds the model: the
                   build has drawn an eager build's initialisation on every rank first (what the recipe's
                   route cost before the draws waited for the load)
  init_then_zero3  ``from_pretrained`` on every rank (what works in ``__init__``), then ``Zero3Engine``
  fsdp2            FSDP2 (``fully_shard`` per decoder layer and the root, on the meta device), rank 0
                   reads the whole checkpoint and ``set_model_state_dict(..., full_state_dict=True,
                   broadcast_from_rank0=True)`` sends each tensor out: what Lightning's
                   ``ModelParallelStrategy`` users run (its strategy applies the same ``fully_shard`` calls)
  deepspeed        DeepSpeed ZeRO-3's Hugging Face path: ``HfDeepSpeedConfig`` then ``from_pretrained``
                   (``zero.Init`` with ``no_init_weights``: rank 0 reads, every module gathered and
                   scattered), then ``deepspeed.initialize`` (``DS_BUILD_OPS=0 pip install deepspeed accelerate``
                   on a host without CUDA; ``--peer-python`` runs this row in another environment's
                   interpreter, so DeepSpeed need not be installed beside zero3)

Before each load the checkpoint's pages are dropped from the page cache (``POSIX_FADV_DONTNEED`` on its
files: nothing else on the machine is touched), so every row reads the disk. Per rank: the load's wall
time (from a barrier to a barrier), the peak growth of anonymous memory (``RssAnon``, sampled every 5 ms:
the process's own memory; pages of a mapped file are the page cache's and are not counted) and of the
whole resident set (``VmRSS``), bytes read from the disk (``read_bytes`` of ``/proc/self/io``), and the
bytes the rank then holds as parameter (and gradient) shards. zero3's time includes building the model as
``configure_model`` does (``of it, build s``; ``zero3_drawn``'s build draws the initialisation, on the
host here). The bound is the disk's own read speed,
measured in the same run: the checkpoint's files read cold with ``O_DIRECT`` by ``--ranks`` threads.
``--family mixtral``: the same for a Mixtral checkpoint (``--experts`` per layer, the Hub's per-expert
``w1`` / ``w2`` / ``w3`` files that zero3 reads by range into the model's fused experts; no FSDP2 row).
``--family llava_next``: a LLaVA-Next whose language model has the Llama shape given and a small CLIP
tower, saved with the Hub's names (``language_model.model...``) that transformers renames on load.
Every row's model must give the same loss on one batch (the ``check`` column: difference from zero3's).
Rows are medians over ``--runs``, after one unmeasured load per row of the small checkpoint (the
program's own files are then in the page cache, as they are after any first run: see ``warm_up``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # this folder, and examples/ (gpt.py)

from processes import (add_peer_python_argument, close_process_group, deepspeed_missing, exit_note,  # noqa: E402
                       package_version, read_result, run_worker)  # fmt: skip

METHODS = ("zero3", "zero3_drawn", "init_then_zero3", "fsdp2", "deepspeed")
FAMILIES = {"llama": "AutoModelForCausalLM", "mixtral": "AutoModelForCausalLM", "llava_next": "AutoModelForImageTextToText"}


def llama_shape(args) -> dict:
    return dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip


def make_checkpoint(args) -> Path:
    """The checkpoint every row loads, written once for this shape (kept between runs)."""
    import torch
    import transformers

    shape = llama_shape(args)
    if args.family == "mixtral":  # the Hub's layout: one w1 / w2 / w3 per expert, fused by the load
        shape.update(num_local_experts=args.experts, num_experts_per_tok=2)
    out = Path(args.dir) / f"{args.family}-{shape['num_hidden_layers']}x{shape['hidden_size']}"
    if (out / "config.json").is_file():
        return out
    torch.manual_seed(0)
    with torch.device("meta"):
        model = _family_model(args.family, shape)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
        for rotary in (m for m in model.modules() if hasattr(m, "original_inv_freq")):
            rotary.inv_freq.copy_(rotary.original_inv_freq)
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size=args.shard_size)
    return out


def _family_model(family: str, shape: dict):
    import transformers as T

    if family == "llava_next":  # a small CLIP tower before the language model (the Hub's names on save)
        vision = T.CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    image_size=32, patch_size=8)  # fmt: skip
        config = T.LlavaNextConfig(vision_config=vision, text_config=T.LlamaConfig(**shape),
                                   image_grid_pinpoints=[[32, 32]], image_token_index=shape["vocab_size"] - 1)  # fmt: skip
        return T.LlavaNextForConditionalGeneration(config)
    name = {"llama": "Llama", "mixtral": "Mixtral"}[family]
    return getattr(T, f"{name}ForCausalLM")(getattr(T, f"{name}Config")(**shape))


def checkpoint_files(checkpoint: Path) -> list[Path]:
    return sorted(checkpoint.glob("*.safetensors"))


def drop_from_cache(files: list[Path]) -> None:
    """Evict the files' pages from the page cache (this file only, nothing else of the machine)."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure_disk(files: list[Path], readers: int) -> dict:
    """The files read cold with O_DIRECT into page-aligned buffers, ``readers`` requests in flight."""
    import mmap

    drop_from_cache(files)
    chunk = 16 << 20
    jobs = [(f, offset) for f in files for offset in range(0, f.stat().st_size, chunk)]

    def read(job: tuple[Path, int]) -> int:
        file, offset = job
        buffer = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT wants
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        try:
            return os.preadv(fd, [buffer], offset)
        finally:
            os.close(fd)
            buffer.close()

    start = time.perf_counter()
    with ThreadPoolExecutor(readers) as pool:
        total = sum(pool.map(read, jobs))
    seconds = time.perf_counter() - start
    return {"read_GBps": total / seconds / 1e9, "bytes": total, "seconds": seconds}


def touch_memory(gigabytes: float) -> None:
    """Write ``gigabytes`` of fresh memory once and free it. On a virtual machine the first write to memory
    the guest has not used lately also faults on the host: on the development VM the same 1 GB of writes
    per rank cost 0.2-2.9 s of system time, the most in whichever row ran first. Touched once here, the
    rows start alike (and the order of the rows rotates between runs)."""
    import torch

    for _ in range(int(gigabytes)):
        torch.ones(1 << 28)  # 1 GiB, written and freed


# ---------------------------------------------------------------------------------------------------
# the workers (one process per rank, under torchrun)


class Sampler:
    """Peak ``RssAnon`` and ``VmRSS`` of this process, read every 5 ms, as growth from when it started."""

    def __init__(self) -> None:
        self.base = self.read()
        self.peak = dict(self.base)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def read() -> dict:
        values = {}
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("RssAnon", "VmRSS"):
                values[key] = int(rest.split()[0]) * 1024
        return values

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            for key, value in self.read().items():
                self.peak[key] = max(self.peak[key], value)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        for key, value in self.read().items():
            self.peak[key] = max(self.peak[key], value)
        return {f"{key}_growth": self.peak[key] - self.base[key] for key in self.peak}


def read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


PHASES: dict[str, float] = {}  # when a row's model was built (zero3's: the rest of its time is the load)


def _auto_class(family: str):
    import transformers

    return getattr(transformers, FAMILIES[family])


def _load_zero3(checkpoint: Path, family: str, drawn: bool = False):
    import torch
    from transformers import AutoConfig

    import lightning_zero3
    from lightning_zero3.engine.layout.materialize import parameters_on_meta

    with parameters_on_meta():  # what configure_model runs in under zero3
        model = _auto_class(family).from_config(AutoConfig.from_pretrained(checkpoint), dtype=torch.float32)
        PHASES["built"] = time.perf_counter()
        if not drawn:  # claimed in the block: nothing is drawn for the checkpoint's tensors
            lightning_zero3.load_pretrained(model, checkpoint)
    if drawn:  # the block has ended: its draws were made, on every rank
        PHASES["built"] = time.perf_counter()
        lightning_zero3.load_pretrained(model, checkpoint)
    engine = lightning_zero3.Zero3Engine(model, lightning_zero3.Zero3Config(tune_collectives=False), device=torch.device("cpu"))
    return model, engine


def _load_zero3_drawn(checkpoint: Path, family: str):
    return _load_zero3(checkpoint, family, drawn=True)


def _load_init_then_zero3(checkpoint: Path, family: str):
    import torch

    import lightning_zero3

    model = _auto_class(family).from_pretrained(checkpoint, dtype=torch.float32)
    engine = lightning_zero3.Zero3Engine(model, lightning_zero3.Zero3Config(tune_collectives=False))
    return model, engine


def _load_fsdp2(checkpoint: Path, family: str):
    model = fsdp2_build(checkpoint)
    fsdp2_broadcast(model, checkpoint)
    return model, None


def fsdp2_build(checkpoint: Path):
    """A Llama built on the meta device, ``fully_shard`` per decoder layer and the root, then given memory."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint), dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    rotary = model.model.rotary_emb
    model._init_weights(rotary)  # a buffer, not in the checkpoint: computed again after to_empty
    return model


def fsdp2_broadcast(model, checkpoint: Path) -> None:
    """Rank 0 reads the whole checkpoint, ``set_model_state_dict`` broadcasts each tensor into the shards."""
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = {}
    if dist.get_rank() == 0:
        for file in checkpoint_files(checkpoint):
            full.update(load_file(file))
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def _load_deepspeed(checkpoint: Path, family: str):
    import deepspeed
    import torch
    from transformers.integrations import HfDeepSpeedConfig

    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": False}}
    keep = HfDeepSpeedConfig(config)  # noqa: F841 - must be alive while from_pretrained runs
    model = _auto_class(family).from_pretrained(checkpoint, dtype=torch.float32)
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=[p for p in model.parameters()])
    return engine.module, engine


def _held_bytes(method: str, model, engine) -> tuple[int, int]:
    """Bytes of parameter shards this rank holds after the load, and of those and gradient shards (zero3)."""
    if method.startswith("zero3") or method == "init_then_zero3":
        report = engine.memory_report()
        params = report["param_shards"] + report["persistent_params"]
        return params, params + report["grad_shards"]
    if method == "fsdp2":
        held = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    else:
        held = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in model.parameters())
    return held, held


def _loss_check(method: str, model, engine, vocab: int) -> float:
    """The loaded model's loss on one fixed batch (every row must give the same)."""
    import torch

    ids = torch.randint(0, vocab, (1, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    if args.worker == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    # imported before the clock starts, as a program that builds the model has them: every row uses them
    import transformers.models.llama.modeling_llama  # noqa: F401
    import transformers.models.mixtral.modeling_mixtral  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401

    import lightning_zero3  # noqa: F401

    import transformers.models.llava_next.modeling_llava_next  # noqa: F401

    checkpoint = Path(args.checkpoint)
    load = globals()[f"_load_{args.worker}"]
    dist.barrier()
    sampler, io_before = Sampler(), read_bytes()
    start = time.perf_counter()
    model, engine = load(checkpoint, args.family)
    dist.barrier()
    seconds = time.perf_counter() - start
    param_bytes, held_bytes = _held_bytes(args.worker, model, engine)
    figures = {"seconds": seconds, "read_bytes": read_bytes() - io_before, **sampler.stop(),
               "held_bytes": held_bytes, "param_bytes": param_bytes}  # fmt: skip
    if "built" in PHASES:
        figures["build_seconds"] = PHASES["built"] - start
    if args.worker.startswith("zero3"):  # parameters under persistence_threshold: whole on every rank
        figures["replicated_elements"] = engine.memory_report()["persistent_params"] // 4  # fp32 masters
    figures["loss"] = _loss_check(args.worker, model, engine, args.vocab)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, figures)
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps({"ranks": everyone}))
    close_process_group()


# ---------------------------------------------------------------------------------------------------
# the launcher


def run_method(method: str, checkpoint: Path, args) -> dict | str:
    drop_from_cache(checkpoint_files(checkpoint))
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        worker_args = [__file__, "--worker", method, "--checkpoint", str(checkpoint), "--result", str(result),
                       "--vocab", str(args.vocab), "--family", args.family]  # fmt: skip
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
        python = args.peer_python if method == "deepspeed" else sys.executable
        code, output = run_worker(worker_args, env, timeout=args.timeout, ranks=args.ranks, python=python)
        # a peer's row that wrote its result (all ranks done) and then aborted at exit still measured its
        # load; the exit is shown. Every worker closes its groups as zero3 does (``close_process_group``):
        # 0 aborts in 30 quick FSDP2 and 20 init_then_zero3 runs, against 2 in 13 and 1 in 9 before; zero3's
        # own row must exit cleanly (1 abort in 40 before, 0 in 60)
        outcome = read_result(result, code, output, exit_may_fail=not method.startswith("zero3"))
    if isinstance(outcome, dict):
        return {"ranks": outcome["ranks"], "exit": exit_note(outcome)}
    return outcome


def small_shape(args) -> argparse.Namespace:
    """``args`` with the quick run's small Llama (2 layers, hidden 256, vocab 1024, 1 MB files)."""
    small = argparse.Namespace(**vars(args))
    small.layers, small.hidden, small.intermediate, small.heads, small.kv_heads = 2, 256, 512, 4, 2
    small.vocab, small.shard_size, small.experts = 1024, "1MB", 4
    return small


def warm_up(methods: list[str], args) -> None:
    """One unmeasured load per method (the small checkpoint, the same ranks), so the measured runs read
    the checkpoint and not the program's own files. A cold page of a mapped library (torch's, the
    transformers code the load runs first) reads up to the disk's read-ahead around it (8 MiB on the
    development machine): with those files dropped from the page cache first, as on a fresh machine,
    rank 0 of the quick zero3 row read 20.6 MB for a 3.4 MB checkpoint, 14-18 MB of it while the model
    was built on the meta device, before any checkpoint byte (CI's fresh machine: 6.9 MB, both ranks)."""
    small = small_shape(args)
    checkpoint = make_checkpoint(small)
    for method in methods:
        outcome = run_method(method, checkpoint, small)
        said = "done" if isinstance(outcome, dict) else outcome[:300]
        print(f"warm-up {method}: {said}", flush=True)


def summarize(rows: dict[str, list], disk: list[dict], checkpoint_bytes: int, args) -> list[str]:
    bandwidth = statistics.median(d["read_GBps"] for d in disk) * 1e9
    bound = checkpoint_bytes / bandwidth
    lines = [
        f"loading a {args.params / 1e9:.2f}B-parameter {args.family.capitalize()} ({checkpoint_bytes / 1e9:.2f} GB of bf16 safetensors, "
        f"{args.files} files) into fp32 shards on {args.ranks} CPU ranks; median of {args.runs} run(s)",
        f"disk: {bandwidth / 1e9:.2f} GB/s cold O_DIRECT read with {args.ranks} readers (runs: "
        + ", ".join(f"{d['read_GBps']:.2f}" for d in disk) + f"); bound = checkpoint / disk = {bound:.2f} s",
        *([f"deepspeed {args.deepspeed_version} (run by {args.peer_python})"] if args.deepspeed_version else []),
        "",
        "method          | load s | of it, build s | x bound | x zero3 | read GB (sum, x ckpt) | RssAnon growth GiB/rank (max) | "
        "VmRSS growth GiB/rank (max) | held GiB/rank | anon / param shards | check",
        "----------------+--------+----------------+---------+---------+-----------------------+-------------------------------+"
        "-----------------------------+---------------+---------------------+------",
    ]
    medians = {}
    for method, runs in rows.items():
        good = [r for r in runs if isinstance(r, dict)]
        if not good:
            lines.append(f"{method:<15} | {runs[-1][:400]}")
            continue
        per_run = [r["ranks"] for r in good]
        med = lambda f: statistics.median(f(ranks) for ranks in per_run)  # noqa: E731
        medians[method] = {
            "seconds": med(lambda ranks: max(r["seconds"] for r in ranks)),
            "build": med(lambda ranks: max(r.get("build_seconds", float("nan")) for r in ranks)),
            "read": med(lambda ranks: sum(r["read_bytes"] for r in ranks)),
            "anon": med(lambda ranks: max(r["RssAnon_growth"] for r in ranks)),
            "rss": med(lambda ranks: max(r["VmRSS_growth"] for r in ranks)),
            "held": med(lambda ranks: max(r["held_bytes"] for r in ranks)),
            "anon_ratio": med(lambda ranks: max(r["RssAnon_growth"] / r["param_bytes"] for r in ranks)),
            "loss": per_run[0][0]["loss"],
        }
    base = medians.get("zero3")
    for method, m in medians.items():
        versus = f"{m['seconds'] / base['seconds']:.2f}" if base else "-"
        check = f"{m['loss'] - base['loss']:+.1e}" if base else "-"
        lines.append(
            f"{method:<15} | {m['seconds']:6.2f} | {m['build']:14.2f} | {m['seconds'] / bound:7.2f} | {versus:>7} | "
            f"{m['read'] / 1e9:8.2f} ({m['read'] / checkpoint_bytes:4.2f}x)       | {m['anon'] / 2**30:29.2f} | "
            f"{m['rss'] / 2**30:27.2f} | {m['held'] / 2**30:13.2f} | "
            f"{m['anon_ratio']:19.2f} | {check}"
        )
    return lines


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Ranks, runs and the Llama's shape (a ~1B model by default), as ``benchmark_startup.py`` takes them too."""
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "zero3-load-benchmark"))
    parser.add_argument("--methods", default=",".join(METHODS))
    add_run_arguments(parser)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--family", choices=tuple(FAMILIES), default="llama", help="the checkpoint's model")
    parser.add_argument("--experts", type=int, default=8, help="Mixtral's experts per layer")
    parser.add_argument("--shard-size", default="500MB", help="save_pretrained's max_shard_size")
    parser.add_argument("--quick", action="store_true", help="a small model and one run")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--warm-gb", type=float, default=16, help="memory written once before the runs")
    parser.add_argument("--json", default="benchmark_load.json")
    add_peer_python_argument(parser)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args = small_shape(args)
        args.runs, args.ranks, args.warm_gb = 1, min(args.ranks, 2), 0
    checkpoint = make_checkpoint(args)
    files = checkpoint_files(checkpoint)
    from safetensors import safe_open

    sizes = []
    for file in files:
        with safe_open(file, "pt") as f:
            sizes += [f.get_slice(k).get_shape() for k in f.keys()]
    args.params = sum(int(__import__("math").prod(s)) for s in sizes)
    args.files = len(files)
    checkpoint_bytes = sum(f.stat().st_size for f in files)
    methods = [m for m in args.methods.split(",") if m]
    if args.family != "llama" and "fsdp2" in methods:  # set_model_state_dict takes the model's own names
        methods.remove("fsdp2")
        print("fsdp2 left out: its row loads the checkpoint's names as they are, and a Mixtral checkpoint holds "
              "one w1 / w2 / w3 per expert where the model has fused experts.gate_up_proj / down_proj, a "
              "LLaVA-Next one the Hub's prefixes (language_model.model...) that transformers renames", flush=True)
    rows: dict[str, list] = {m: [] for m in methods}
    if "deepspeed" in methods and deepspeed_missing(args.peer_python):
        methods.remove("deepspeed")
        rows["deepspeed"] = [deepspeed_missing(args.peer_python)]
    args.deepspeed_version = package_version(args.peer_python, "deepspeed") if "deepspeed" in methods else ""
    disk = []
    touch_memory(args.warm_gb)
    warm_up(methods, args)
    for run in range(args.runs):
        disk.append(measure_disk(files, args.ranks))
        for method in methods[run % len(methods) :] + methods[: run % len(methods)]:  # each row first once
            rows[method].append(run_method(method, checkpoint, args))
            outcome = rows[method][-1]
            said = (f"{max(r['seconds'] for r in outcome['ranks']):.2f} s{outcome['exit']}"
                    if isinstance(outcome, dict) else outcome[:300])  # fmt: skip
            print(f"run {run + 1}/{args.runs} {method}: {said}", flush=True)
    lines = summarize(rows, disk, checkpoint_bytes, args)
    print("\n".join(lines))
    Path(args.json).write_text(json.dumps({"rows": rows, "disk": disk, "table": lines}, indent=1))


if __name__ == "__main__":
    main()
