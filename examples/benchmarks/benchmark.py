"""zero3 side by side with its peers, in one run: DDP, torch FSDP2 and DeepSpeed ZeRO-3.

Question: How fast does zero3 train, and with how much memory per rank, against DDP, FSDP2 and DeepSpeed?

    python examples/benchmarks/benchmark.py                       # ~20M-parameter GPT, 2 CPU ranks, 3 runs each
    python examples/benchmarks/benchmark.py --runs 5 --steps 30   # more samples
    python examples/benchmarks/benchmark.py --n-layer 2 --n-embd 64 --steps 6 --runs 1   # a quick look
    python examples/benchmarks/benchmark.py --accelerator cuda --devices 1 --precision bf16-mixed --strategies zero3,ddp,fsdp2
    python examples/benchmarks/benchmark.py --nodes 2             # 2 simulated nodes x 2 ranks: bytes crossing nodes
    python examples/benchmarks/benchmark.py --compile --strategies zero3,ddp,fsdp2   # every block torch.compile'd in place

With ``--nodes N`` every run is N torchrun agents on this host meeting at a c10d rendezvous, each starting
``--devices`` ranks (``examples/benchmarks/nodes.py``), the Trainer gets ``num_nodes=N``, and the table adds the bytes
one rank receives from other nodes per step. The strategies then default to zero3, zero3 with secondary
shards (``zero3_hpz``: ``secondary_shard_size="node"``), zero3 with int8 gathers (``zero3_int8``), both
(``zero3_hpz_int8``), DDP, and FSDP2 as HSDP (``fully_shard`` over a 2-D (replicate, shard) mesh: replicas across nodes, shards inside one).

Every strategy trains the same GPT on the same data for the same steps, with the same seed; the runs
alternate between strategies (A B C D, B C D A, ...) so that drift of the machine hits all alike. Each
run is a fresh set of processes:

- ``zero3``, ``ddp`` and ``fsdp2`` go through a Lightning ``Trainer`` (FSDP2 is Lightning's
  ``ModelParallelStrategy`` with ``fully_shard`` applied per block in ``configure_model``);
- ``deepspeed`` is the ``deepspeed`` package's ZeRO-3 engine driven by a plain loop under ``torchrun``
  (Lightning's DeepSpeed strategy refuses CPUs), run by ``--peer-python`` (an environment of its own may
  hold DeepSpeed); it is reported as skipped when DeepSpeed is missing there;
- ``single`` is plain Lightning on one device (``Trainer(strategy="auto", devices=1)``, no process group
  and no wrapper), for ``--devices 1``: what zero3 at world size 1 is measured against on a GPU. Its
  losses differ from DDP's and zero3's from the first step (by 0.1% on a 2-layer model: Lightning's
  single-device path starts from other random numbers; not investigated), so compare its time only;
- ``zero3_fabric`` is zero3 behind Lightning Fabric (``Fabric(strategy=Zero3FabricStrategy(...))``), the same
  model, optimizer and batches in a plain Fabric loop: the cost of the second front door.

The table: median step time (the warm-up steps excluded), the CPU time rank 0's process spent per step
(every thread of it: compute and the collectives' own; on a host whose cores the ranks share, this is
what competes), tokens/s, the ratio to DDP, the highest
per-rank peak resident memory (the kernel's ``VmHWM``), per-rank model-state bytes (parameters +
gradients + optimizer state held at the optimizer step), zero3's exposed communication (time the
compute side waited for collectives, as a share of the step), and the largest relative difference of
each strategy's per-step losses from DDP's; below it, the host's facts (``host_facts.py``). ``--json``
writes the same figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # this folder, and examples/ (gpt.py, data.py)

from host_facts import describe_host, host_facts  # noqa: E402
from processes import (add_peer_python_argument, close_process_group, deepspeed_missing, exit_note, package_version,  # noqa: E402
                       peak_rss, read_result, run_worker)  # fmt: skip

STRATEGIES = ("zero3", "ddp", "fsdp2", "deepspeed", "zero3_fabric", "zero3_hpz", "zero3_int8", "zero3_hpz_int8",
              "single")
ONE_NODE = "zero3,ddp,fsdp2,deepspeed,zero3_fabric"
SEVERAL_NODES = "zero3,zero3_hpz,zero3_int8,zero3_hpz_int8,ddp,fsdp2"
# zero3's variants: the settings each adds to ``--zero3``
ZERO3_VARIANTS = {
    "zero3": {},
    "zero3_hpz": {"secondary_shard_size": "node"},
    "zero3_int8": {"quantize_gathers": "int8"},
    "zero3_hpz_int8": {"secondary_shard_size": "node", "quantize_gathers": "int8"},
}
# what a worker needs to know of the parent's arguments
WORKER_ARGS = ("steps", "warmup", "devices", "nodes", "batch_size", "block_size", "n_layer", "n_embd", "n_head",
               "vocab_size", "zero3", "accelerator", "precision", "compile")  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", default=None,
                   help=f"comma-separated, of {', '.join(STRATEGIES)}; default {ONE_NODE} ({SEVERAL_NODES} with --nodes > 1)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the timing")
    p.add_argument("--devices", type=int, default=2, help="ranks per node")
    p.add_argument("--nodes", type=int, default=1, help="simulated nodes, each a torchrun agent on this host")
    p.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu", help="zero3, ddp and fsdp2 only")
    p.add_argument("--precision", default="32-true", help="Lightning's precision flag (zero3, ddp and fsdp2 only)")
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=448)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--compile", action="store_true",
                   help="compile every block in place (torch.compile, in configure_model, before the strategy "
                        "shards or wraps the model); zero3, ddp and fsdp2 only")
    p.add_argument("--zero3", default="", metavar="KNOB=VALUE,...",
                   help="zero3 settings for this run, e.g. overlap_comm=False,prefetch_bucket_size=0")
    p.add_argument("--json", type=Path, default=Path("benchmark.json"))
    add_peer_python_argument(p)
    p.add_argument("--worker", choices=STRATEGIES, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------------
# the parent: alternate the runs, then print the table


def main(args: argparse.Namespace) -> dict:
    strategies = (args.strategies or (SEVERAL_NODES if args.nodes > 1 else ONE_NODE)).split(",")
    results: dict[str, list[dict]] = {s: [] for s in strategies}
    skipped: dict[str, str] = {}
    for run in range(args.runs):
        order = strategies[run % len(strategies) :] + strategies[: run % len(strategies)]
        for strategy in order:
            if strategy in skipped:
                continue
            outcome = launch(strategy, args)
            if isinstance(outcome, str) and outcome.startswith("failed"):
                # one retry for a launch that failed (a transient cause such as a port taken between
                # being chosen and bound); the first failure is printed, not hidden
                print(f"run {run + 1}/{args.runs} {strategy}: {outcome}\n  retrying once", file=sys.stderr, flush=True)
                outcome = launch(strategy, args)
            if isinstance(outcome, str):
                skipped[strategy] = outcome
            else:
                results[strategy].append(outcome)
            print(f"run {run + 1}/{args.runs} {strategy}: {describe(outcome)}", flush=True)
    summary = summarize(results, skipped, args)
    print()
    print(table(summary, args))
    args.json.write_text(json.dumps(summary, indent=2))
    print(f"\nwritten to {args.json}")
    return summary


def launch(strategy: str, args: argparse.Namespace) -> dict | str:
    if strategy == "deepspeed" and deepspeed_missing(args.peer_python):
        return deepspeed_missing(args.peer_python)
    if strategy == "deepspeed" and args.nodes > 1:
        return "skipped: not run across simulated nodes (its launcher is not Lightning's)"
    if strategy == "single" and args.devices * args.nodes != 1:
        return "skipped: single runs on one device (--devices 1)"
    if args.compile and strategy in ("deepspeed", "zero3_fabric"):
        return "skipped: --compile compiles the Lightning Trainer's rows only"
    forwarded = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in WORKER_ARGS if name != "compile"]
    forwarded += ["--compile"] if args.compile else []
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        worker = [str(HERE / "benchmark.py"), *forwarded, "--worker", strategy, "--result", str(result)]
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        if args.nodes > 1:
            from nodes import run_as_nodes

            code, output = run_as_nodes(worker, args.nodes, args.devices, env, timeout=3600)
        else:
            deepspeed = strategy == "deepspeed"
            code, output = run_worker(worker, env, timeout=3600, ranks=args.devices if deepspeed else 0,
                                      python=args.peer_python if deepspeed else sys.executable)  # fmt: skip
        return read_result(result, code, output, exit_may_fail=strategy == "deepspeed")


def describe(outcome: dict | str) -> str:
    if isinstance(outcome, str):
        return outcome
    return f"median step {statistics.median(outcome['step_times']):.3f} s{exit_note(outcome)}"


def summarize(results: dict[str, list[dict]], skipped: dict[str, str], args) -> dict:
    tokens = args.nodes * args.devices * args.batch_size * args.block_size
    rows: dict[str, dict] = {}
    for strategy, runs in results.items():
        if not runs:
            continue
        step = statistics.median(statistics.median(r["step_times"]) for r in runs)
        exposed = [r["exposed_comm_per_step"] for r in runs if r.get("exposed_comm_per_step") is not None]
        rows[strategy] = {
            "step_time_s": step,
            # CPU seconds one rank's process (all its threads: compute, the collectives') spends per step
            "cpu_s_per_step": statistics.median(statistics.median(r["cpu_times"]) for r in runs),
            "tokens_per_s": tokens / step,
            "peak_rss_bytes": statistics.median(r["peak_rss_bytes"] for r in runs),
            "model_state_bytes": statistics.median(r["model_state_bytes"] for r in runs),
            "exposed_comm_s": statistics.median(exposed) if exposed else None,
            "losses": runs[0]["losses"],
            "runs": len(runs),
        }
        if args.nodes > 1:  # bytes are the same in every run (the same collectives): the first run's
            rows[strategy]["inter_node_bytes_per_step"] = runs[0]["inter_node_bytes_per_step"]
            rows[strategy]["counted_inter_node_bytes_per_step"] = runs[0]["counted_inter_node_bytes_per_step"]
    reference = rows.get("ddp")
    for row in rows.values():
        if reference:
            row["step_time_x_ddp"] = row["step_time_s"] / reference["step_time_s"]
            row["model_state_x_ddp"] = row["model_state_bytes"] / reference["model_state_bytes"]
            row["loss_max_rel_diff_vs_ddp"] = max(
                abs(a - b) / abs(b) for a, b in zip(row["losses"], reference["losses"])
            )
        if row["exposed_comm_s"] is not None:
            row["exposed_comm_share"] = row["exposed_comm_s"] / row["step_time_s"]
    config = vars(args) | {"json": str(args.json), "result": None}
    if "deepspeed" in rows:
        config["deepspeed_version"] = package_version(args.peer_python, "deepspeed")
    return {"config": config, "host": host_facts(), "rows": rows, "skipped": skipped}


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"  # None: no DDP row in the run


def table(summary: dict, args) -> str:
    head = ("strategy", "step s", "CPU s/step", "tokens/s", "x DDP", "peak RSS/rank MiB", "model states/rank MiB",
            "x DDP", "exposed comm", "losses vs DDP")  # fmt: skip
    several = args.nodes > 1
    if several:
        head += ("inter-node MB/step/rank", "x DDP", "counted MB")
    reference = summary["rows"].get("ddp", {}).get("inter_node_bytes_per_step")
    lines = [head]
    for name, row in summary["rows"].items():
        share = row.get("exposed_comm_share")
        diff = row.get("loss_max_rel_diff_vs_ddp")
        lines.append((
            name,
            f"{row['step_time_s']:.3f}",
            f"{row['cpu_s_per_step']:.3f}",
            f"{row['tokens_per_s']:.0f}",
            _ratio(row.get("step_time_x_ddp")),
            f"{row['peak_rss_bytes'] / 2**20:.0f}",
            f"{row['model_state_bytes'] / 2**20:.1f}",
            _ratio(row.get("model_state_x_ddp")),
            f"{share:.1%}" if share is not None else "n/a",
            "n/a" if diff is None else (f"match ({diff:.0e})" if diff <= 1e-4 else f"DIFFER ({diff:.1e})"),
        ))  # fmt: skip
        if several:
            inter = row["inter_node_bytes_per_step"]
            lines[-1] += (
                f"{inter / 1e6:.2f}", f"{inter / reference:.2f}" if reference else "n/a",
                f"{row['counted_inter_node_bytes_per_step'] / 1e6:.2f}",
            )  # fmt: skip
    for name, why in summary["skipped"].items():
        lines.append((name, why.splitlines()[0][:90]) + ("",) * (len(head) - 2))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = [" | ".join(cell.ljust(width) for cell, width in zip(line, widths)) for line in lines]
    out.insert(1, "-+-".join("-" * width for width in widths))
    cfg = summary["config"]
    ranks = f"{args.nodes} nodes x {args.devices}" if several else f"{args.devices}"
    out.append(
        f"\nGPT {cfg['n_layer']} layers x {cfg['n_embd']} wide, {ranks} {args.accelerator.upper()} ranks, "
        f"batch {cfg['batch_size']} x {cfg['block_size']} tokens per rank, {args.precision} AdamW"
        f"{', every block compiled' if cfg.get('compile') else ''}; "
        f"median over {cfg['runs']} runs of "
        f"{cfg['steps'] - cfg['warmup']} timed steps."
        + (f" deepspeed {cfg['deepspeed_version']} (run by {cfg['peer_python']})." if cfg.get("deepspeed_version") else "")
    )
    out.append(describe_host(summary["host"]))
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------
# the workers: one strategy, one run; rank 0 writes the result


def model_config(args):
    from gpt import GPTConfig

    return GPTConfig(vocab_size=args.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                     n_head=args.n_head, n_embd=args.n_embd)  # fmt: skip


def dataset(args):
    from gpt import random_tokens

    ranks = args.nodes * args.devices
    return random_tokens(args.steps * ranks * args.batch_size, args.block_size, args.vocab_size, seed=1)


def zero3_knobs(text: str) -> dict:
    """``"a=1,b=False"`` -> ``{"a": 1, "b": False}`` (values read as Python literals)."""
    import ast

    knobs = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        try:
            knobs[name.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            knobs[name.strip()] = value.strip()
    return knobs


def tensor_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def state_bytes(optimizer) -> int:
    return tensor_bytes(v for s in optimizer.state.values() for v in s.values() if hasattr(v, "numel"))


def lightning_worker(strategy: str, args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from gpt import GPTModule, apply_fsdp2
    from lightning.pytorch.strategies import ModelParallelStrategy
    from nodes import CrossNodeCounter
    from torch.utils.data import DataLoader

    import lightning_zero3

    # bytes from other nodes, counted inside torch.distributed's collectives (see nodes.py), timed steps only
    counter = CrossNodeCounter(args.devices).install() if args.nodes > 1 else None

    class BenchGPT(GPTModule):
        def configure_model(self):
            if args.compile:  # in place, before any strategy shards or wraps: each block keeps its hooks
                for block in self.model.blocks:
                    block.compile()
            if isinstance(self.trainer.strategy, ModelParallelStrategy):  # FSDP2: one unit per block
                from torch.distributed.device_mesh import init_device_mesh

                mesh = self.device_mesh["data_parallel"]
                if args.nodes > 1:  # HSDP: replicas across nodes, shards within a node
                    shape, names = (args.nodes, args.devices), ("replicate", "shard")
                    mesh = init_device_mesh(self.device.type, shape, mesh_dim_names=names)
                apply_fsdp2(self.model, mesh)

    class Probe(pl.Callback):
        def __init__(self) -> None:
            self.step_times, self.losses, self.model_state, self.comm_at_warmup = [], [], 0, None
            self.cpu_times = []  # CPU seconds of this process (every thread: compute, gloo) per timed step
            self._start = 0.0
            self.ledger_inter_node = 0  # zero3: bytes from other nodes in its own ledger, timed steps
            self._ledger_at_start = 0

        def on_train_start(self, trainer, pl_module):
            if counter is not None and isinstance(trainer.strategy.model, torch.nn.parallel.DistributedDataParallel):
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                # DDP's built-in all-reduce runs in C++, out of the counter's sight (and Lightning registers
                # hooks on CUDA only): this hook all-reduces each bucket the same way, from Python
                trainer.strategy.model.register_comm_hook(None, default_hooks.allreduce_hook)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == args.warmup:
                self.comm_at_warmup = exposed_seconds(trainer)
            if counter is not None:
                counter.counting = batch_idx >= args.warmup
                self._ledger_at_start = ledger_inter_node(trainer)
            finish_device_work(trainer)
            self._start, self._cpu_start = time.perf_counter(), time.process_time()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            engine = getattr(trainer.strategy, "engine", None)
            if engine is not None:
                r = engine.memory_report()
                # one process: the weights are the gathered buffers themselves (no separate shard)
                alone = sum(rt.group.full.numel() * rt.group.full.element_size() for rt in engine.runtimes
                            if rt.group.master_is_full and not rt.group.persistent)  # fmt: skip
                self.model_state = (
                    r["param_shards"] + r["persistent_params"] + r["grad_shards"] + r["optimizer_state"] + alone
                )
            else:
                params = list(pl_module.parameters())
                self.model_state = tensor_bytes(params) + tensor_bytes(p.grad for p in params) + state_bytes(optimizer)

        def on_train_end(self, trainer, pl_module):
            self.comm_at_end = exposed_seconds(trainer)  # before teardown closes the engine

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            finish_device_work(trainer)  # a GPU step ends when its kernels do, not when they are queued
            elapsed, cpu = time.perf_counter() - self._start, time.process_time() - self._cpu_start
            if batch_idx >= args.warmup:
                self.step_times.append(elapsed)
                self.cpu_times.append(cpu)
            if counter is not None:
                counter.counting = False  # not the loss's all-reduce below
                if batch_idx >= args.warmup:
                    self.ledger_inter_node += ledger_inter_node(trainer) - self._ledger_at_start
            self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))

    def finish_device_work(trainer):
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)

    def exposed_seconds(trainer):
        engine = getattr(trainer.strategy, "engine", None)
        return None if engine is None else sum(s.exposed_seconds for s in engine.comm.stats.values())

    def ledger_inter_node(trainer):
        engine = getattr(trainer.strategy, "engine", None)
        return 0 if engine is None else engine.comm.inter_node_total()

    pl.seed_everything(0)
    # On one GPU every row builds the model on it: a 1B GPT's initialisation on the host took 19 s on a
    # 2-core CPU, longer than its timed steps, in every process of a short GPU run.
    one_gpu = args.accelerator == "cuda" and args.devices * args.nodes == 1
    with torch.device("cuda") if one_gpu else contextlib.nullcontext():
        model = BenchGPT(model_config(args))
    if strategy in ZERO3_VARIANTS:
        chosen = lightning_zero3.Zero3Strategy(**{**zero3_knobs(args.zero3), **ZERO3_VARIANTS[strategy]})
    elif strategy == "ddp":
        chosen = "ddp"
    elif strategy == "single":
        chosen = "auto"  # one device: Lightning's SingleDeviceStrategy
    else:
        chosen = ModelParallelStrategy(data_parallel_size=args.nodes * args.devices, tensor_parallel_size=1)
    probe = Probe()
    trainer = pl.Trainer(strategy=chosen, accelerator=args.accelerator, num_nodes=args.nodes, devices=args.devices,
                         max_steps=args.steps, precision=args.precision, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[probe])  # fmt: skip
    trainer.fit(model, DataLoader(dataset(args), batch_size=args.batch_size))
    exposed = None
    if probe.comm_at_warmup is not None:
        exposed = (probe.comm_at_end - probe.comm_at_warmup) / len(probe.step_times)
    device = trainer.strategy.root_device  # an NCCL group reduces device tensors only
    rss = torch.tensor([peak_rss()], dtype=torch.float64, device=device)
    state = torch.tensor([probe.model_state], dtype=torch.float64, device=device)
    rss, state = (trainer.strategy.reduce(t, reduce_op="max") for t in (rss, state))
    extra = {}
    if counter is not None:  # per step, mean over ranks
        counted, ledger = (
            trainer.strategy.reduce(torch.tensor([float(value)], dtype=torch.float64, device=device), reduce_op="mean")
            for value in (counter.bytes, probe.ledger_inter_node)
        )
        engine = getattr(trainer.strategy, "engine", None)
        steps = len(probe.step_times)
        extra = {
            "inter_node_bytes_per_step": (ledger if engine is not None else counted).item() / steps,
            "counted_inter_node_bytes_per_step": counted.item() / steps,
        }
    if trainer.is_global_zero:
        extra = {**extra, "cpu_times": probe.cpu_times}
        write_result(args, probe.step_times, probe.losses, int(rss.item()), int(state.item()), exposed, extra)
    close_process_group()


def deepspeed_worker(args: argparse.Namespace) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from gpt import GPT

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(model_config(args))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-3)  # fmt: skip
    config = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    # the same batches as Lightning's injected sampler: shuffled with the global seed (0), split by rank
    data = dataset(args)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    step_times, losses, cpu_times = [], [], []
    for step, (x, y) in enumerate(loader):
        start, cpu_start = time.perf_counter(), time.process_time()
        logits = engine(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        engine.backward(loss)
        if step == args.steps - 1:
            state = deepspeed_model_state(engine)
        engine.step()
        if step >= args.warmup:
            step_times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    figures = torch.tensor([peak_rss(), state], dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    if rank == 0:
        write_result(args, step_times, losses, int(figures[0]), int(figures[1]), None, {"cpu_times": cpu_times})
    close_process_group()  # deepspeed.init_distributed leaves it open, as Lightning's DDP does


def deepspeed_model_state(engine) -> int:
    """Parameter partitions, fp32 master partitions, gradient partitions and optimizer state of this rank."""
    opt = engine.optimizer
    total = tensor_bytes(getattr(p, "ds_tensor", None) for p in engine.module.parameters())
    total += tensor_bytes(getattr(opt, "fp32_partitioned_groups_flat", []))
    total += tensor_bytes([getattr(opt, "grad_partitions_flat_buffer", None)])
    total += state_bytes(opt.optimizer)
    return total


def write_result(args, step_times, losses, rss, state, exposed, extra: dict | None = None) -> None:
    args.result.write_text(json.dumps({
        "step_times": step_times, "losses": losses, "peak_rss_bytes": rss,
        "model_state_bytes": state, "exposed_comm_per_step": exposed, **(extra or {}),
    }))  # fmt: skip


def fabric_worker(args: argparse.Namespace) -> None:
    """zero3 through Fabric: the Trainer rows' model (``GPTModule``'s GPT and optimizer), batches and steps."""
    import torch
    import torch.nn.functional as F
    from gpt import GPTModule
    from lightning.fabric import Fabric
    from torch.utils.data import DataLoader

    import lightning_zero3

    strategy = lightning_zero3.Zero3FabricStrategy(**zero3_knobs(args.zero3))
    fabric = Fabric(strategy=strategy, accelerator=args.accelerator, devices=args.devices, precision=args.precision)
    fabric.launch()
    fabric.seed_everything(0)
    module = GPTModule(model_config(args))  # the Trainer rows' GPT and its optimizer, built the same way
    optimizer = module.configure_optimizers()
    model, optimizer = fabric.setup(module.model, optimizer)
    # the same batches as Lightning's injected sampler: shuffled with the global seed (0), split by rank
    data = dataset(args)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=fabric.world_size, rank=fabric.global_rank, seed=0)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=args.batch_size, sampler=sampler),
                                      use_distributed_sampler=False)  # fmt: skip
    step_times, losses, state, cpu_times = [], [], 0, []
    engine = strategy.engine
    comm_at_warmup = None
    for step, (x, y) in enumerate(loader):
        if step == args.warmup:
            comm_at_warmup = sum(s.exposed_seconds for s in engine.comm.stats.values())
        if args.accelerator == "cuda":
            torch.cuda.synchronize()
        start, cpu_start = time.perf_counter(), time.process_time()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        fabric.backward(loss)
        report = engine.memory_report()
        state = report["param_shards"] + report["persistent_params"] + report["grad_shards"] + report["optimizer_state"]
        optimizer.step()
        optimizer.zero_grad()
        if args.accelerator == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            step_times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
        losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
    exposed = (sum(s.exposed_seconds for s in engine.comm.stats.values()) - comm_at_warmup) / len(step_times)
    figures = fabric.all_reduce(torch.tensor([peak_rss(), state], dtype=torch.float64, device=fabric.device), reduce_op="max")
    if fabric.global_rank == 0:
        write_result(args, step_times, losses, int(figures[0]), int(figures[1]), exposed, {"cpu_times": cpu_times})


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.worker == "deepspeed":
        deepspeed_worker(arguments)
    elif arguments.worker == "zero3_fabric":
        fabric_worker(arguments)
    elif arguments.worker:
        lightning_worker(arguments.worker, arguments)
    else:
        main(arguments)
