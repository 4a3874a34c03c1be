"""The figures of each offload plan: bytes per rank on the training device and in host memory, bytes per
node in host memory and on NVMe.

[Note: what each plan keeps where]
Dtypes follow the engine (``layout/slots.py``): the shards are the masters, in the parameters' own dtype
(fp32 under ``32-true`` and ``*-mixed``: 4 bytes, 2 under ``*-true``); gradient shards and the optimizer's
state (``state_per_element`` tensors, 2 for Adam) share that dtype; units are gathered in the compute
dtype. Under ``*-mixed`` that is the field's 16 bytes per parameter (4 + 4 + 8), with no separate fp32
copy: the ``masters`` figure is 0 because the parameter shards are the masters.

    plan                 device holds                     host holds                       NVMe holds
    none                 shards, grads, state             -                                -
    optimizer->cpu       shards                           grads, state (step on the host)  -
    all->cpu             -                                shards, grads, state             -
    optimizer->nvme      shards                           staging                          grads, state
    all->nvme            -                                staging + parameter read-ahead   shards, grads, state

Staging under NVMe (``offload/tiers.py``): ``offload_buffer_count`` groups' master, gradient and two state
buffers of the largest group's shard (what a pipelined step holds at once); with parameters on NVMe the
read-ahead of ``offload_buffer_count`` groups' shards as well. On a CPU run the device is the host: each
rank's figure is its whole resident memory, host and device parts together.

Everything a step holds besides model states: persistent parameters (whole on every rank), the gathered
units at their peak (the root while forward runs, plus the running unit and its prefetch window, within
``prefetch_bucket_size`` and ``max_live_parameters``), the staging buffers the engine's pool keeps (see
[Note: the staging pool keeps what it used]), the activations (measured, see facts.py) and the runtime's
own baseline (the process before any model: the caller measures it or states it).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional

from ...config.settings import OffloadTier
from .facts import Activations, ModelFacts

#: (name, offload_optimizer, offload_params), lightest first: each plan moves more off the device, and costs
#: more time per step, than the one before it.
PLANS = (
    ("none", None, None),
    ("optimizer->cpu", OffloadTier.CPU, None),
    ("all->cpu", OffloadTier.CPU, OffloadTier.CPU),
    ("optimizer->nvme", OffloadTier.NVME, None),
    ("all->nvme", OffloadTier.NVME, OffloadTier.NVME),
)


@dataclass(frozen=True)
class Job:
    """What the estimate needs to know of the run besides the model."""

    world_size: int
    ranks_per_node: int
    master_bytes: int = 4  # bytes per element of shards, gradient shards and optimizer state
    compute_bytes: int = 4  # bytes per element of gathered units
    reduce_bytes: int = 4  # bytes per element of gradients being reduce-scattered
    state_per_element: int = 2  # optimizer state tensors per element (Adam: 2)
    prefetch_numel: int = 50_000_000
    max_live_numel: int = 1_000_000_000
    buffer_count: int = 4  # offload_buffer_count
    activation_checkpointing: bool = False
    on_cpu: bool = False  # the device is the host: figures per rank are its resident memory
    device_memory: Optional[int] = None  # per rank: budget the plans are held to (None: nothing fits-checked)
    host_memory: Optional[int] = None  # per node
    nvme_bytes_free: Optional[int] = None  # per node
    baseline_device: int = 0  # the runtime's own bytes on the device (on CPU: the process's resident baseline)
    baseline_host: int = 0  # the runtime's own host bytes per rank (on CPU: 0, counted in baseline_device)


@dataclass
class PlanEstimate:
    plan: str
    offload_optimizer: Optional[str]
    offload_params: Optional[str]
    # per rank, wherever they live
    param_shards: int
    grad_shards: int
    masters: int
    optimizer_state: int
    persistent_params: int
    gathered_peak: int
    grad_staging: int
    activations: int
    activations_checkpointed: int
    baseline: int
    nvme_staging: int
    kept_between_steps: int  # the staging on the device that the first step fills and every later step starts with
    # where they live
    model_state_bytes_per_rank: int  # shards + gradients + masters + state, wherever they are
    device_bytes_per_rank: int
    host_bytes_per_rank: int
    host_bytes_per_node: int
    nvme_bytes: int  # per node
    trim_between_phases: bool = False  # idle staging buffers go back between phases (see below)
    fits: Optional[bool] = None
    why: list = field(default_factory=list)
    selected: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


def _gathered_window(units: tuple[int, ...], prefetch: int, max_live: int) -> int:
    """Most elements of non-root units gathered at once: a unit and the prefetch window after it."""
    best = 0
    for i, first in enumerate(units):
        held, ahead = first, 0
        for nxt in units[i + 1 :]:
            if ahead + nxt > prefetch or held + nxt > max_live:
                break
            ahead += nxt
            held += nxt
        best = max(best, held)
    return best


def estimate_plans(facts: ModelFacts, activations: Activations, job: Job, buffer_count: Optional[int] = None) -> list[PlanEstimate]:
    """One ``PlanEstimate`` per plan of ``PLANS``, fits-checked against ``job``'s memory when it gives it."""
    return [estimate_plan(name, opt, par, facts, activations, job, buffer_count) for name, opt, par in PLANS]


def estimate_plan(name: str, offload_optimizer: Optional[str], offload_params: Optional[str], facts: ModelFacts,
                  activations: Activations, job: Job, buffer_count: Optional[int] = None,
                  trim_between_phases: bool = False) -> PlanEstimate:  # fmt: skip
    m = job.master_bytes
    params = facts.shard_numel * m
    grads = facts.trainable_shard_numel * m
    state = facts.trainable_shard_numel * m * job.state_per_element
    persistent = facts.persistent_numel * job.compute_bytes
    window = _gathered_window(facts.unit_numels, job.prefetch_numel, job.max_live_numel)
    gathered = (facts.root_numel + window) * job.compute_bytes
    # [Note: the staging pool keeps what it used] the engine's pool (memory/buffers.py, ``BufferPool`` without
    # a bound) keeps every buffer it has handed out, for reuse at the same size: per unit size the gather's
    # landing, the gradient landing buffer and the reduce-scatter send buffer (three full units), the reduced
    # and the source shards (two shards), and the next unit's landing while one is reduced (one full unit
    # more); counting fewer leaves the estimate below the run's peak, and a plan chosen by it over budget
    largest = facts.largest_unit_numel
    grad_staging = (facts.root_numel + 4 * largest + 2 * math.ceil(largest / facts.world_size)) * job.reduce_bytes
    # the running unit's backward: its saved tensors are freed as they are used, while its gradients
    # w.r.t. inputs and weights appear: one unit's saved bytes more at the peak
    backward = max(activations.unit_saved, default=activations.largest_tensor)
    act_full = activations.saved + backward
    act_ckpt = activations.checkpointed() + backward
    act = act_ckpt if job.activation_checkpointing else act_full
    count = buffer_count if buffer_count is not None else job.buffer_count
    largest_group = max(facts.group_shard_numels, default=0) * m
    staging = 0  # NVMe staging at its peak (the optimizer step); in forward and backward only ``streaming``
    streaming = 0  # gradients written behind as backward reduces them, and parameter shards read ahead
    if offload_optimizer == OffloadTier.NVME:
        staging = count * (2 + job.state_per_element) * largest_group
        streaming = count * largest_group
        if offload_params == OffloadTier.NVME:
            staging += count * largest_group
            streaming += count * largest_group

    on_device = {"params": params, "grads": grads, "state": state}
    on_host = {}
    on_nvme = {}
    if offload_optimizer == OffloadTier.CPU:
        on_host.update(grads=on_device.pop("grads"), state=on_device.pop("state"))
    elif offload_optimizer == OffloadTier.NVME:
        on_nvme.update(grads=on_device.pop("grads"), state=on_device.pop("state"))
    if offload_params == OffloadTier.CPU:
        on_host["params"] = on_device.pop("params")
    elif offload_params == OffloadTier.NVME:
        on_nvme["params"] = on_device.pop("params")
    transient = persistent + gathered + grad_staging + act
    device = sum(on_device.values()) + transient + job.baseline_device
    host = sum(on_host.values()) + staging + job.baseline_host
    if job.on_cpu:  # one memory: the rank's resident set holds it all
        device = host = device + host
        if trim_between_phases:
            # [Note: the plan's levels] in dynamic.py: gradient staging goes back when backward ends and NVMe
            # staging after the optimizer step, so the two phases peak apart; forward and backward hold only
            # what streams through them (gradients written behind, parameter shards read ahead)
            phases = max(gathered + grad_staging + act + streaming, staging)
            device = host = device - (gathered + grad_staging + act + staging) + phases
    model_states = params + grads + state
    estimate = PlanEstimate(
        plan=name, offload_optimizer=offload_optimizer, offload_params=offload_params,
        param_shards=params, grad_shards=grads, masters=0, optimizer_state=state, persistent_params=persistent,
        gathered_peak=gathered, grad_staging=grad_staging, activations=act_full, activations_checkpointed=act_ckpt,
        baseline=job.baseline_device + (0 if job.on_cpu else job.baseline_host), nvme_staging=staging,
        kept_between_steps=0 if trim_between_phases else grad_staging + (staging if job.on_cpu else 0),
        model_state_bytes_per_rank=model_states, device_bytes_per_rank=device, host_bytes_per_rank=host,
        host_bytes_per_node=host * job.ranks_per_node, nvme_bytes=sum(on_nvme.values()) * job.ranks_per_node,
        trim_between_phases=trim_between_phases,
    )  # fmt: skip
    _check_fit(estimate, job)
    return estimate


def _check_fit(estimate: PlanEstimate, job: Job) -> None:
    checks = []
    if job.device_memory is not None:
        checks.append(("device memory per rank", estimate.device_bytes_per_rank, job.device_memory))
    if job.host_memory is not None:
        checks.append(("host memory per node", estimate.host_bytes_per_node, job.host_memory))
    if job.nvme_bytes_free is not None and estimate.nvme_bytes:
        checks.append(("NVMe space per node", estimate.nvme_bytes, job.nvme_bytes_free))
    if not checks:
        return
    estimate.why = [f"{what}: needs {need / 1e9:.2f} GB of {have / 1e9:.2f} GB" for what, need, have in checks
                    if need > have]  # fmt: skip
    estimate.fits = not estimate.why
