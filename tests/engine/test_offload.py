"""Offload (``offload_optimizer`` / ``offload_params``): the state contract, the swap folder, failures,
Lightning resume, and capacity: NVMe offload trains a model whose states are 4x the process's peak RSS."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from benchmark_offload import Layers
from distributed import run_ranks, run_script
from gpt import GPT, GPTConfig, random_tokens
from late_copies import LateCopies, LateTicket
from torch import nn

import lightning_zero3
from lightning_zero3 import Zero3Config, Zero3ConfigError, Zero3Engine, Zero3Strategy, gathered_parameters
from lightning_zero3.checkpoint import (
    NonFiniteCheckpointError,
    load_sharded_checkpoint,
    optimizer_pieces,
    save_sharded_checkpoint,
)
from lightning_zero3.checkpoint.full import save_full_checkpoint
from lightning_zero3.engine.memory.buffers import OFFLOAD_HOST, host_buffer
from lightning_zero3.engine.offload import NvmePathError, SwapDiskFullError, tiers
from lightning_zero3.engine.offload import aio as aio_module
from lightning_zero3.engine.offload.swapdir import SwapDirectory

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=64)
# Offload steps Adam with torch's fused CPU kernel (1 ulp from the loop the reference runs): weights
# agree to this absolute tolerance, the parity tests' (measured: a few 1e-7 after 3 steps).
WEIGHT_ATOL = 5e-5
MODES = {
    "cpu": {"offload_optimizer": "cpu", "offload_params": "cpu"},
    "cpu_params_on_device": {"offload_optimizer": "cpu"},
    "nvme": {"offload_optimizer": "nvme", "offload_params": "nvme"},
    "nvme_params_in_cpu": {"offload_optimizer": "nvme", "offload_params": "cpu"},
}


def _config(mode: str, tmp_path: Path, **extra) -> Zero3Config:
    knobs = dict(MODES.get(mode, {}))
    if "nvme" in knobs.values():
        knobs["nvme_path"] = str(tmp_path)
    return Zero3Config(persistence_threshold=500, **knobs, **extra)


def _train(model: nn.Module, optimizer, steps: int, start: int = 0) -> list[float]:
    data = random_tokens(64, CFG.block_size, CFG.vocab_size, seed=5)
    losses = []
    for step in range(start, start + steps):
        x, y = data[step * 4 : step * 4 + 4]
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _engine(mode: str, tmp_path: Path, **extra):
    torch.manual_seed(0)
    model = GPT(CFG)
    engine = Zero3Engine(model, _config(mode, tmp_path, **extra))
    optimizer = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    return model, engine, optimizer


@pytest.fixture(autouse=True)
def late_copies(monkeypatch):
    """Every offload test here runs with device <-> host copies that complete late (see late_copies.py)."""
    monkeypatch.setattr(tiers, "COPY_ENGINE", LateCopies)


# -- the state contract ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(MODES))
def test_states_in_memory_full_states_and_close_match_no_offload(mode, tmp_path):
    model, engine, optimizer = _engine("none", tmp_path)
    reference = _train(model, optimizer, 3)
    full_weights, full_state = engine.full_state_dict(), engine.full_optimizer_state(optimizer)

    model, engine, optimizer = _engine(mode, tmp_path)
    assert _train(model, optimizer, 3) == pytest.approx(reference, rel=1e-6)
    with engine.states_in_memory():  # every shard parameter and its Adam state: real tensors
        for slot in engine.slots.values():
            p = slot.shard_param
            assert p.numel() == slot.hi - slot.lo and p.device.type == "cpu"
            state = optimizer.state[p]
            if p.numel():
                assert state["exp_avg"].shape == p.shape and torch.isfinite(state["exp_avg_sq"]).all()
        fc = engine.slots[id(model.blocks[1].fc.weight)].shard_param
        fc.data[:3] = 7.0  # written back on exit, to the tier and to what all-gathers read
        optimizer.state[fc]["exp_avg"][:3] = 0.25
    if "nvme" in mode:
        assert fc.numel() == 0 and optimizer.state[fc]["exp_avg"].numel() == 0  # swapped out: placeholders
        assert engine.memory_report()["optimizer_state"] < 1000  # the step counters only
    with engine.states_in_memory():
        assert fc[:3].tolist() == [7.0] * 3 and optimizer.state[fc]["exp_avg"][:3].tolist() == [0.25] * 3
    with gathered_parameters(model.blocks[1]):
        assert model.blocks[1].fc.weight.reshape(-1)[:3].tolist() == [7.0] * 3

    # full states (what checkpoints hold) equal the run without offload's, and load back exactly
    ours, our_state = engine.full_state_dict(), engine.full_optimizer_state(optimizer)
    ours["blocks.1.fc.weight"].view(-1)[:3] = full_weights["blocks.1.fc.weight"].view(-1)[:3]
    our_state["state"][_index_of(optimizer, fc)]["exp_avg"].view(-1)[:3] = (
        full_state["state"][_index_of(optimizer, fc)]["exp_avg"].view(-1)[:3]
    )
    for name, value in full_weights.items():
        torch.testing.assert_close(ours[name], value, rtol=0, atol=WEIGHT_ATOL, msg=name)
    assert our_state["param_groups"] == full_state["param_groups"]  # the user's flags, not the host kernel's
    for index, values in full_state["state"].items():
        for key, value in values.items():
            torch.testing.assert_close(our_state["state"][index][key], value, rtol=1e-4, atol=WEIGHT_ATOL)
    engine.load_full_state_dict(full_weights)
    engine.load_full_optimizer_state(optimizer, full_state)
    resumed = _train(model, optimizer, 2, start=3)

    model, engine_ref, optimizer_ref = _engine("none", tmp_path)
    engine_ref.load_full_state_dict(full_weights)
    engine_ref.load_full_optimizer_state(optimizer_ref, full_state)
    assert resumed == pytest.approx(_train(model, optimizer_ref, 2, start=3), rel=1e-6)

    engine.close()  # ordinary full tensors again, the optimizer over them; swap files gone
    assert all(p.numel() == q.numel() for p, q in zip(model.parameters(), GPT(CFG).parameters()))
    assert not any(tmp_path.glob("lightning_zero3-*/*"))


def _index_of(optimizer, param) -> int:
    return next(i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"]) if p is param)


def test_clipping_and_accumulation_see_the_offloaded_gradients(tmp_path):
    results = {}
    for mode in ("none", "nvme", "cpu"):
        model, engine, optimizer = _engine(mode, tmp_path)
        data = random_tokens(32, CFG.block_size, CFG.vocab_size, seed=9)
        norms = []
        for step in range(3):
            for micro in range(2):  # two micro-batches accumulate into one gradient
                x, y = data[(2 * step + micro) * 2 : (2 * step + micro) * 2 + 2]
                logits = model(x)
                F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
            norms.append(float(engine.clip_grad_norm_(0.05)))
            optimizer.step()
            optimizer.zero_grad()
        results[mode] = (norms, engine.full_state_dict())
        engine.close()
    for mode in ("nvme", "cpu"):
        assert results[mode][0] == pytest.approx(results["none"][0], rel=1e-5)
        for name, value in results["none"][1].items():
            torch.testing.assert_close(results[mode][1][name], value, rtol=0, atol=WEIGHT_ATOL, msg=name)


def test_the_late_copy_engine_really_completes_copies_late():
    target, source = torch.zeros(4), torch.ones(4)
    ticket = LateCopies(torch.device("cpu"), False, None).copy(target, source)
    assert target.tolist() == [0.0] * 4  # a read without waiting sees the old values
    ticket.wait_host()
    assert target.tolist() == [1.0] * 4 and isinstance(ticket, LateTicket)


def _passes(model, engine, optimizer, data, step: int) -> dict:
    """One step with every gradient pass a Lightning run makes: fp16 unscale, clip by value and by norm."""
    x, y = data[step * 2 : step * 2 + 2]
    logits = model(x)
    (F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)) * 4.0).backward()  # a "scaled" loss
    watched = {}
    with engine.ledger.watch() as watched["unscale"]:
        found_inf = engine.unscale_gradients_(0.25)
    with engine.ledger.watch() as watched["clip"]:
        engine.clip_grad_value_(0.05)
        norm = float(engine.clip_grad_norm_(0.1))
    optimizer.step()
    optimizer.zero_grad()
    return {"found_inf": found_inf, "norm": norm, "watched": watched}


def test_nvme_streams_gradient_passes_and_checkpoints_within_the_buffer_count(tmp_path):
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=12, n_head=2, n_embd=64)
    data = random_tokens(32, cfg.block_size, cfg.vocab_size, seed=11)
    runs = {}
    for mode in ("none", "nvme"):
        torch.manual_seed(0)
        model = GPT(cfg)
        knobs = {"offload_buffer_count": 2, **MODES.get(mode, {})}
        engine = Zero3Engine(model, Zero3Config(persistence_threshold=500, nvme_path=str(tmp_path), **knobs))
        optimizer = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        steps = [_passes(model, engine, optimizer, data, step) for step in range(3)]
        phases = {}
        with engine.ledger.watch() as phases["sharded save"]:
            save_sharded_checkpoint(tmp_path / mode / "sharded", engine, [optimizer], {})
        with engine.ledger.watch() as phases["full save"]:
            save_full_checkpoint(tmp_path / mode / "full.ckpt", engine, [optimizer], {})
        weights = engine.full_state_dict()
        with engine.ledger.watch() as phases["sharded load"]:
            load_sharded_checkpoint(tmp_path / mode / "sharded", engine, [optimizer])
        with engine.ledger.watch() as phases["full load"]:
            full = torch.load(tmp_path / mode / "full.ckpt", mmap=True, weights_only=True)
            engine.load_full_state_dict(full["state_dict"])
            engine.load_full_optimizer_state(optimizer, full["optimizer_states"][0])
        after_load = [_passes(model, engine, optimizer, data, step) for step in range(3, 5)]
        if mode == "nvme":  # a NaN in a moment that lives only in its swap file: refused from the bytes being written
            piece = next(value for entry in optimizer_pieces(engine, optimizer)["state"].values()
                         for key, value in entry.items() if key == "exp_avg" and value.source is not None
                         and value.tensor.numel())  # fmt: skip
            aio_module.write_range(piece.source.file, torch.full((1,), float("nan")), piece.source.offset)
            with engine.ledger.watch() as phases["refused save"]:
                with pytest.raises(NonFiniteCheckpointError, match=r"optimizer\.0\..*\.exp_avg holds 1 non-finite"):
                    save_sharded_checkpoint(tmp_path / mode / "refused", engine, [optimizer], {"global_step": 5})
            assert not list((tmp_path / mode).glob(".refused.partial-*"))
        largest = max(rt.group.shard_numel * 4 for rt in engine.runtimes)  # bytes of one fp32 shard
        states = 16 * sum(p.numel() for p in GPT(cfg).parameters())
        runs[mode] = {"steps": steps, "after_load": after_load, "phases": phases, "weights": weights,
                      "largest": largest, "states": states}  # fmt: skip
        engine.close()
    nvme, reference = runs["nvme"], runs["none"]
    # the same numbers as without offload: deferred unscale and clipping applied at the step
    for ours, theirs in zip(nvme["steps"] + nvme["after_load"], reference["steps"] + reference["after_load"]):
        assert ours["found_inf"] is theirs["found_inf"] is False
        assert ours["norm"] == pytest.approx(theirs["norm"], rel=1e-5)
    for name, value in reference["weights"].items():
        torch.testing.assert_close(nvme["weights"][name], value, rtol=0, atol=WEIGHT_ATOL, msg=name)
    # host memory: never more than offload_buffer_count (2) groups' master, gradient and two moments,
    # far below the rank's states (12 blocks); the gradient passes hold no more than the step does
    bound = 2 * 4 * nvme["largest"]
    watched = {f"step {i} {name}": w for i, s in enumerate(nvme["steps"]) for name, w in s["watched"].items()}
    for phase, peaks in {**watched, **nvme["phases"]}.items():
        assert peaks[OFFLOAD_HOST] <= bound, (phase, peaks[OFFLOAD_HOST], bound)
    assert bound < nvme["states"] / 4


# -- the swap folder ---------------------------------------------------------------------------------


def test_swap_files_are_private_and_removed_also_after_a_crash(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"lightning_zero3-{os.getuid()}" / f"{os.uname().nodename}-{int(dead.stdout)}-r0"
    stale.mkdir(parents=True)
    (stale / "g0-master.swp").write_bytes(b"left by a crashed run")
    model, engine, optimizer = _engine("nvme", tmp_path)
    _train(model, optimizer, 1)
    assert not stale.exists()  # the crashed run's folder is gone
    folder = engine.offload.swap.path
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and stat.S_IMODE(folder.parent.stat().st_mode) == 0o700
    files = list(folder.iterdir())
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert sum(f.stat().st_size for f in files) == engine.memory_report()["offload_nvme"]
    engine.close()
    assert not folder.exists()


def test_nvme_path_is_checked_before_training(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(NvmePathError, match="a_file.*cannot be created.*nvme_path"):
        _engine("nvme", blocker / "swap")
    monkeypatch.setattr("shutil.disk_usage", lambda path: _Usage(free=1000))
    with pytest.raises(NvmePathError, match=r"has 1000 bytes free, but the master and gradient shards needs \d+ bytes"):
        _engine("nvme", tmp_path)


class _Usage:
    def __init__(self, free: int) -> None:
        self.free = free


def test_a_full_disk_during_training_is_a_clear_error_and_leaves_the_checkpoint_intact(tmp_path, monkeypatch):
    model, engine, optimizer = _engine("nvme", tmp_path / "swap")
    _train(model, optimizer, 1)
    checkpoint = tmp_path / "last.ckpt"
    torch.save({"weights": engine.full_state_dict(), "optimizer": engine.full_optimizer_state(optimizer)}, checkpoint)
    digest = hashlib.sha256(checkpoint.read_bytes()).hexdigest()

    def full_disk(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(aio_module.os, "pwrite", full_disk)
    with pytest.raises(SwapDiskFullError) as error:
        _train(model, optimizer, 1, start=1)
    assert str(tmp_path / "swap") in str(error.value) and "bytes" in str(error.value)
    assert "resume from the last checkpoint" in str(error.value)
    monkeypatch.undo()
    assert hashlib.sha256(checkpoint.read_bytes()).hexdigest() == digest
    restored = torch.load(checkpoint)
    assert restored["weights"].keys() == model.state_dict(keep_vars=True).keys()


def _direct_reads(monkeypatch) -> list[tuple[int, int]]:
    """(descriptor, bytes) of every read that ``aio`` issues, recorded as they happen."""
    seen, preadv = [], os.preadv

    def recorded(fd, buffers, offset):
        got = preadv(fd, buffers, offset)
        seen.append((fd, got))
        return got

    monkeypatch.setattr(aio_module.os, "preadv", recorded)
    return seen


def _accepts_direct_reads(directory: Path) -> bool:
    """Whether a file in ``directory`` opens with ``O_DIRECT`` and reads an aligned block through it."""
    probe = directory / "o_direct_probe"
    try:
        probe.write_bytes(b"\0" * 8192)
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
        try:
            return os.preadv(fd, [memoryview(host_buffer(1024, torch.float32).numpy()).cast("B")], 0) == 4096
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        return False
    finally:
        probe.unlink(missing_ok=True)


@pytest.fixture
def direct_dir(tmp_path):
    """A directory whose file system takes ``O_DIRECT`` reads: the test's own temporary directory, else one
    beside the repository or in /var/tmp (a CI runner's temporary directory is often a tmpfs that refuses
    them), so that the direct path runs wherever the machine has such a file system at all."""
    import tempfile

    repository = Path(__file__).resolve().parents[2]
    for candidate in (tmp_path, repository, Path("/var/tmp")):
        if not candidate.is_dir() or not os.access(candidate, os.W_OK):
            continue
        with tempfile.TemporaryDirectory(dir=candidate, prefix="zero3-direct-") as directory:
            if _accepts_direct_reads(Path(directory)):
                yield Path(directory)
                return
    pytest.skip(f"no file system here takes O_DIRECT reads (tried {tmp_path}, {repository}, /var/tmp): the direct "
                "path cannot run; the buffered fallback and the alignment rule are tested without it")  # fmt: skip


def test_swap_reads_bypass_the_page_cache_for_aligned_blocks_and_see_fresh_writes(direct_dir, monkeypatch):
    """[Note: direct reads] in engine/offload/aio.py: a page-aligned host buffer is read through the O_DIRECT descriptor
    for its whole 4 KiB blocks and through the cache for the rest; the data is what was just written
    through the buffered descriptor (no fsync in between); an unaligned target reads through the cache."""
    swap_dir = SwapDirectory(str(direct_dir), rank=0)
    numel = 3 * 1024 * 1024 + 5  # 12 MiB and 20 bytes: a tail that is not a whole block
    swap = swap_dir.create("probe", numel * 4)
    assert swap.direct_fd is not None  # the directory takes O_DIRECT: the swap file opened with it
    written = torch.randn(numel)
    aio_module.write_range(swap, written, 0)
    seen = _direct_reads(monkeypatch)
    target = host_buffer(numel, torch.float32)
    aio_module.read_range(swap, target, 0)
    assert torch.equal(target, written)
    assert sum(n for fd, n in seen if fd == swap.direct_fd) == numel * 4 // 4096 * 4096
    assert sum(n for fd, n in seen if fd == swap.fd) == numel * 4 % 4096
    seen.clear()
    unaligned = host_buffer(numel + 1, torch.float32)[1:]
    aio_module.read_range(swap, unaligned, 0)
    assert torch.equal(unaligned, written) and {fd for fd, _ in seen} == {swap.fd}
    swap_dir.remove()


def test_only_aligned_whole_blocks_go_to_the_direct_descriptor():
    """The alignment rule of [Note: direct reads], on any host (no O_DIRECT needed): the tensor's address
    and the file offset both multiples of DIRECT_ALIGN, then the whole blocks of the request; else none."""
    align, aligned = aio_module.DIRECT_ALIGN, host_buffer(3 * 1024 + 5, torch.float32)
    nbytes = aligned.numel() * 4
    assert aio_module._direct_bytes(7, aligned, 0, nbytes) == nbytes // align * align == 3 * align
    assert aio_module._direct_bytes(7, aligned, 2 * align, nbytes) == 3 * align
    assert aio_module._direct_bytes(7, aligned, 100, nbytes) == 0  # offset inside a block
    assert aio_module._direct_bytes(7, aligned[1:], 0, nbytes - 4) == 0  # address inside a page
    assert aio_module._direct_bytes(7, aligned, 0, align - 4) == 0  # less than one block
    assert aio_module._direct_bytes(None, aligned, 0, nbytes) == 0  # no direct descriptor


def test_a_file_system_that_refuses_o_direct_at_open_reads_through_the_cache(tmp_path, monkeypatch):
    """Where the file system refuses the flag at open (tmpfs on older kernels, some network file systems),
    the swap file has no direct descriptor and every read goes through the cache, with the same bytes."""
    from lightning_zero3.engine.offload import swapdir

    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(swapdir.os, "open", refusing_open)
    swap_dir = SwapDirectory(str(tmp_path), rank=0)
    swap = swap_dir.create("probe", 1 << 20)
    assert swap.direct_fd is None
    monkeypatch.undo()
    written = torch.randn((1 << 20) // 4)
    aio_module.write_range(swap, written, 0)
    seen = _direct_reads(monkeypatch)
    target = host_buffer(written.numel(), torch.float32)  # aligned: only the missing descriptor stops it
    aio_module.read_range(swap, target, 0)
    assert torch.equal(target, written)
    assert {fd for fd, _ in seen} == {swap.fd} and sum(n for _, n in seen) == 1 << 20
    swap_dir.remove()


def test_a_file_system_that_refuses_direct_reads_falls_back_to_the_cache(tmp_path, monkeypatch):
    """A file system that takes the flag at open but refuses the reads (EINVAL): the read is done again
    through the cache, with the same bytes, and the file reads through the cache from then on. The direct
    descriptor is stood in for by a second plain one where the file system refuses O_DIRECT."""
    swap_dir = SwapDirectory(str(tmp_path), rank=0)
    swap = swap_dir.create("probe", 1 << 20)
    if swap.direct_fd is None:  # refused at open: a stand-in descriptor, refused at read below
        swap.direct_fd = swap._direct_opened = os.open(swap.path, os.O_RDONLY)
    written = torch.randn((1 << 20) // 4)
    aio_module.write_range(swap, written, 0)
    direct, preadv, tried = swap.direct_fd, os.preadv, []

    def refusing(fd, buffers, offset):
        if fd == direct:
            tried.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return preadv(fd, buffers, offset)

    monkeypatch.setattr(aio_module.os, "preadv", refusing)
    target = host_buffer(written.numel(), torch.float32)
    aio_module.read_range(swap, target, 0)
    assert tried == [direct]  # the direct read was tried once
    assert torch.equal(target, written) and swap.direct_fd is None
    swap_dir.remove()


# -- configuration and registration -------------------------------------------------------------------


@pytest.mark.parametrize(
    "knobs,words",
    [
        ({"offload_params": "cpu"}, ["offload_params='cpu'", "offload_optimizer", "offload_optimizer='cpu'"]),
        ({"offload_optimizer": "cpu", "offload_params": "nvme"}, ["offload_params='nvme'", "offload_optimizer='nvme'"]),
        ({"offload_optimizer": "nvme"}, ["nvme_path"]),
        ({"offload_optimizer": "disk"}, ["offload_optimizer='disk'", '"cpu" or "nvme"']),
        ({"offload_buffer_count": 1}, ["offload_buffer_count", ">= 2"]),
        ({"offload_optimizer": "auto", "nvme_path": "/tmp", "memory_budget": "lots"}, ["memory_budget='lots'", '"24GB"']),
        ({"memory_budget": "2GB"}, ["read only by the automatic plan", 'offload_optimizer="auto"']),
        ({"offload_optimizer": "auto"}, ["nvme_path"]),
    ],
)
def test_offload_settings_are_validated(knobs, words):
    with pytest.raises(Zero3ConfigError) as error:
        Zero3Strategy(**knobs)
    for word in words:
        assert word in str(error.value)


@pytest.mark.parametrize("flavour", ["lightning.pytorch", "pytorch_lightning"])
def test_offload_names_are_registered(flavour):
    framework = pytest.importorskip(flavour)
    for name, tier in (("zero3_offload", "cpu"), ("zero3_offload_nvme", "nvme")):
        trainer = framework.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
        config = trainer.strategy.config
        assert type(trainer.strategy).__name__ == "Zero3Strategy"
        assert (config.offload_optimizer, config.offload_params) == (tier, tier)
    assert config.nvme_path == lightning_zero3.config.settings.default_nvme_path()


def test_checkpoint_resume_under_offload_is_exact(tmp_path):
    script = Path(__file__).parents[1] / "scripts" / "flows_run.py"
    for offload in ("cpu", "nvme"):
        out = tmp_path / offload
        run_script(script, "resume", "--out", out, "--offload", offload)
        for rank in range(2):
            r = json.loads((out / f"resume-rank{rank}.json").read_text())
            assert r["first"] == r["straight"][:3]
            assert r["zero3"] == r["straight"][3:]  # bitwise from the sharded checkpoint, states from the tiers
            assert r["zero3_from_full"] == r["straight"][3:]  # and from the full one
            assert r["ddp"] == pytest.approx(r["straight"][3:], rel=1e-6)  # the checkpoint loads under DDP
        assert not any((out / "nvme").glob("lightning_zero3-*/*"))


# -- capacity ----------------------------------------------------------------------------------------


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):  # the kernel's high-water mark of this process's resident memory
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _capacity_case(rank: int, world: int, width: int, depth: int, knobs: dict, out: str) -> dict:
    model = Layers(width, depth)  # created uninitialised: nothing resident until the engine shards a layer
    engine = Zero3Engine(model, Zero3Config(persistence_threshold=0, **knobs))
    for i, block in enumerate(model.blocks):  # initialised one layer at a time, through the engine
        with gathered_parameters(block, modifier_rank=0), torch.no_grad():
            block.weight.copy_(torch.randn(block.weight.shape, generator=torch.Generator().manual_seed(i)) / width)
    optimizer = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-5))
    x = torch.randn(8, width, generator=torch.Generator().manual_seed(100 + rank))
    losses = []
    for _ in range(3):
        loss = (model(x) - x).pow(2).mean()
        loss.backward()
        engine.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    save_sharded_checkpoint(Path(out) / "checkpoint", engine, [optimizer], {})  # and back: a resume
    load_sharded_checkpoint(Path(out) / "checkpoint", engine, [optimizer])
    report = engine.memory_report()
    engine.trim()  # the end of a run: the module stays sharded, the swap files go
    engine.release_offload()
    # the whole run's peak, as the kernel saw it, in the default environment (no allocator settings)
    return {"losses": losses, "peak_rss": _peak_rss(), "params": sum(p.numel() for p in model.parameters()),
            **report}  # fmt: skip


def test_nvme_offload_trains_a_model_four_times_larger_than_its_peak_memory(tmp_path, monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)  # the default environment a user has
    width, depth = 1024, 160  # 168M parameters: 2.7 GB of model states
    knobs = {"offload_optimizer": "nvme", "offload_params": "nvme", "nvme_path": str(tmp_path), "offload_buffer_count": 2}
    (offloaded,) = run_ranks(_capacity_case, 1, width, depth, knobs, str(tmp_path / "offloaded"))
    (resident,) = run_ranks(_capacity_case, 1, width, depth, {}, str(tmp_path / "resident"))
    states = 16 * offloaded["params"]  # fp32 parameter, gradient, Adam's two moments
    print(f"\nmodel states {states / 2**20:.0f} MiB; peak RSS with NVMe offload {offloaded['peak_rss'] / 2**20:.0f} MiB "
          f"({states / offloaded['peak_rss']:.2f}x), without {resident['peak_rss'] / 2**20:.0f} MiB")  # fmt: skip
    assert states >= 4 * offloaded["peak_rss"]
    assert offloaded["offload_nvme"] == states  # every byte of it lived on disk
    assert offloaded["losses"] == pytest.approx(resident["losses"], rel=1e-5)
    assert offloaded["losses"][-1] < offloaded["losses"][0]
    assert not any(tmp_path.glob("lightning_zero3-*/*"))  # removed when the process ended
