"""``lightning-zero3 estimate``: per-rank memory of every offload plan of a job, and whether it fits.

    lightning-zero3 estimate --config examples/configs/gpt_zero3.yaml
    lightning-zero3 estimate --hf llama-70b/config.json --devices 8 --device-memory 80GB --json

Any other argument after the known ones is handed to the job's YAML as ``fit`` takes it
(``--trainer.devices 4``, ``--model.init_args.cfg.n_layer 8``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from ...config.precision_flags import PRECISION_FLAGS
from ...config.settings import Zero3Config, parse_budget
from ...engine.plan import Job, choose_plan, estimate_plans, measure_activations, model_facts
from ...engine.memory.proc import MEMINFO, kib_field_bytes
from ...engine.plan.choose import NothingFitsError
from . import baseline
from .job import JobSpec, from_hf, from_yaml

COLUMNS = (("param_shards", "params"), ("grad_shards", "grads"), ("optimizer_state", "optim"),
           ("persistent_params", "persist"), ("gathered_peak", "gathered"), ("grad_staging", "grad stage"),
           ("activations", "activ"), ("activations_checkpointed", "activ ckpt"), ("nvme_staging", "nvme stage"),
           ("kept_between_steps", "kept"), ("baseline", "baseline"), ("device_bytes_per_rank", "TOTAL/rank"), ("host_bytes_per_node", "host/node"),
           ("nvme_bytes", "nvme/node"))  # fmt: skip


def parse_args(argv) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="lightning-zero3 estimate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="the job's YAML, as `fit` takes it")
    source.add_argument("--hf", help="a Hugging Face model: its directory or config.json")
    p.add_argument("--devices", type=int, help="ranks per node (default: the job's trainer.devices; --hf: 8)")
    p.add_argument("--num-nodes", type=int, help="nodes (default: the job's; --hf: 1)")
    p.add_argument("--device-memory", help='per rank, e.g. "80GB" (CPU jobs: host memory / ranks per node)')
    p.add_argument("--host-memory", help='per node, e.g. "1TB" (default on CPU: this machine\'s)')
    p.add_argument("--nvme-path", help="swap directory: its free space is checked")
    p.add_argument("--precision", help="--hf: bf16-mixed (default), 32-true, 16-mixed, bf16-true, 16-true")
    p.add_argument("--batch-size", type=int, help="samples per rank per step (--hf default 1)")
    p.add_argument("--seq-len", type=int, help="tokens per sample (--hf default 4096)")
    p.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                   help="fits-check with every unit checkpointed (default: off for --config, on for --hf, as "
                        "large models are trained)")  # fmt: skip
    p.add_argument("--cpu", action="store_true", help="--hf: the ranks run on CPU (the device is the host)")
    p.add_argument("--json", action="store_true", help="a list of objects, one per plan")
    return p.parse_known_args(argv)


def load_job(args: argparse.Namespace, overrides: list[str]) -> JobSpec:
    if args.config:
        if args.devices:
            overrides = [*overrides, "--trainer.devices", str(args.devices)]
        if args.num_nodes:
            overrides = [*overrides, "--trainer.num_nodes", str(args.num_nodes)]
        return from_yaml(args.config, overrides, args.batch_size, args.seq_len)
    return from_hf(args.hf, Zero3Config(), args.precision or "bf16-mixed", args.devices or 8, args.num_nodes or 1,
                   args.batch_size or 1, args.seq_len or 4096, on_cpu=args.cpu)  # fmt: skip


def run(argv) -> list[dict]:
    args, overrides = parse_args(argv)
    spec = load_job(args, overrides)
    cfg = spec.config
    world = spec.devices * spec.num_nodes
    facts = model_facts(spec.model, cfg.unit_modules, cfg.persistence_threshold, world)
    activations = measure_activations(spec.model, spec.step, unit_modules=cfg.unit_modules,
                                      persistence_threshold=cfg.persistence_threshold, seq_len=spec.seq_len)  # fmt: skip
    host = parse_budget(args.host_memory) if args.host_memory else (kib_field_bytes(MEMINFO, "MemTotal") if spec.on_cpu else None)
    if args.device_memory:
        device = parse_budget(args.device_memory)
    elif spec.on_cpu and host:
        device = host // spec.devices
    elif cfg.memory_budget not in (None, "auto"):
        device = parse_budget(cfg.memory_budget)
    else:
        device = None
    host_rank = baseline.host_baseline()
    flag = PRECISION_FLAGS[spec.precision]
    master, compute = flag.master_bytes, flag.compute_bytes
    nvme_free = shutil.disk_usage(args.nvme_path).free if args.nvme_path and os.path.isdir(args.nvme_path) else None
    job = Job(
        world_size=world, ranks_per_node=spec.devices, master_bytes=master, compute_bytes=compute,
        reduce_bytes=4 if cfg.reduce_dtype in (None, "fp32") else 2, prefetch_numel=cfg.prefetch_bucket_size,
        max_live_numel=cfg.max_live_parameters, buffer_count=cfg.offload_buffer_count,
        activation_checkpointing=args.activation_checkpointing if args.activation_checkpointing is not None
        else bool(args.hf), on_cpu=spec.on_cpu, device_memory=device,
        host_memory=host, nvme_bytes_free=nvme_free,
        baseline_device=host_rank if spec.on_cpu else baseline.CUDA_CONTEXT, baseline_host=0 if spec.on_cpu else host_rank,
    )  # fmt: skip
    rows = estimate_plans(facts, activations, job)
    wanted = (cfg.offload_optimizer, cfg.offload_params)
    if "auto" in wanted and device is not None:
        try:
            chosen, _, _ = choose_plan(facts, activations, job, *wanted)
            wanted = (chosen.offload_optimizer, chosen.offload_params)
            rows = [chosen if row.plan == chosen.plan else row for row in rows]  # at the sizing it was chosen with
        except NothingFitsError:
            wanted = (None, None, None)
    out = []
    for row in rows:
        row.selected = (row.offload_optimizer, row.offload_params) == wanted
        record = {"plan": row.plan, **row.as_dict(), "params": facts.total_numel, "world_size": world,
                  "ranks_per_node": spec.devices, "precision": spec.precision, "batch_size": spec.batch_size,
                  "seq_len": spec.seq_len, "device_memory": device, "host_memory": host,
                  "activation_checkpointing": job.activation_checkpointing}  # fmt: skip
        out.append(record)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(table(out, spec, facts.total_numel, world))
    return out


def table(rows: list[dict], spec: JobSpec, params: int, world: int) -> str:
    gb = lambda v: f"{v / 1e9:.2f}"  # noqa: E731
    head = ["plan", *[label for _, label in COLUMNS], "fits", "selected"]
    lines = [head]
    for r in rows:
        fits = {True: "yes", False: "NO", None: "?"}[r["fits"]]
        lines.append([r["plan"], *[gb(r[key]) for key, _ in COLUMNS], fits, "<-" if r["selected"] else ""])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))) for line in lines]
    where = "host (CPU ranks: one memory)" if spec.on_cpu else "device"
    device = rows[0]["device_memory"]
    title = (f"{spec.label}: {params / 1e9:.3f}B parameters, {world} ranks ({spec.devices} per node), {spec.precision}, "
             f"batch {spec.batch_size} x {spec.seq_len} per rank; GB per rank unless said; estimates, {where}"
             + (f"; budget {device / 1e9:.2f} GB per rank" if device else "")
             + ("; totals with activation checkpointing" if rows[0]["activation_checkpointing"] else ""))  # fmt: skip
    note = ("kept: the staging the first step fills and every later step starts with (grad stage, and on CPU ranks "
            "nvme stage too): the growth after the first step, counted in TOTAL/rank")
    if any(r["trim_between_phases"] for r in rows):
        note += ("\nthe selected plan returns idle buffers between phases: TOTAL/rank counts the larger of backward's "
                 "staging (grad stage and what streams through it) and the optimizer step's (nvme stage), and kept is 0")
    return "\n".join([title, *text, note])


def main(argv=None) -> int:
    run(sys.argv[1:] if argv is None else argv)
    return 0
