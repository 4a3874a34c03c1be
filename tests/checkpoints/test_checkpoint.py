"""Sharded checkpoints driven by plain torch on CPU ranks: resharding N -> M with parity, damage, consolidation."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from checkpoint_files import assert_sharded_layout
from distributed import run_ranks
from gpt import GPT, GPTConfig, random_tokens
from torch import nn

from lightning_zero3 import Zero3Config, Zero3Engine
from lightning_zero3.checkpoint import (
    CheckpointError,
    CheckpointMismatchError,
    NonFiniteCheckpointError,
    UnsafeCheckpointError,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
    write_sharded_checkpoint,
)
from lightning_zero3.checkpoint.consolidate import consolidate_checkpoint
from lightning_zero3.checkpoint.dcp_io import read_dcp_metadata
from lightning_zero3.checkpoint.files import load_file_checkpoint
from lightning_zero3.checkpoint.full import save_full_checkpoint
from lightning_zero3.checkpoint.sharded import param_names
from lightning_zero3.cli import main as cli_main
from lightning_zero3.engine import Communicator

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
GLOBAL_BATCH = 4  # samples per step, split evenly over 1, 2 or 4 ranks
CONFIG = Zero3Config(persistence_threshold=500)  # shards the blocks' weights, keeps LayerNorms whole


def _global_batch(step: int):
    data = random_tokens(64, CFG.block_size, CFG.vocab_size, seed=5)
    return data[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]


def _local_batch(rank: int, world: int, step: int):
    x, y = _global_batch(step)
    per = GLOBAL_BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _sharded(seed: int, cfg: GPTConfig = CFG, config: Zero3Config = CONFIG):
    torch.manual_seed(seed)
    model = GPT(cfg)
    engine = Zero3Engine(model, config)
    optimizer = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1))
    return model, engine, optimizer


def _train(model, optimizer, rank: int, world: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = _loss(model, *_local_batch(rank, world, step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _save_case(rank: int, world: int, path: str, config: Zero3Config = CONFIG) -> dict:
    model, engine, optimizer = _sharded(seed=0, config=config)
    _train(model, optimizer, rank, world, range(3))
    save_sharded_checkpoint(Path(path), engine, [optimizer], {"step": 3})
    return {"weights": engine.full_state_dict(), "optimizer": engine.full_optimizer_state(optimizer),
            "groups": len(engine.runtimes)}  # fmt: skip


def _load_case(rank: int, world: int, path: str) -> dict:
    model, engine, optimizer = _sharded(seed=1)  # other initial weights: everything must come from the file
    extra = load_sharded_checkpoint(Path(path), engine, [optimizer])
    loaded = {"weights": engine.full_state_dict(), "optimizer": engine.full_optimizer_state(optimizer)}
    losses = []
    for step in range(3, 6):
        losses.append(float(torch.tensor(_train(model, optimizer, rank, world, range(step, step + 1))[0])))
    return {"extra": extra, "loaded": loaded, "losses": losses, "weights": engine.full_state_dict()}


def _reference(saved: dict) -> tuple[list[float], dict]:
    """The same three steps on one process, on the whole global batch, from the saved full state."""
    torch.manual_seed(2)
    model = GPT(CFG)
    model.load_state_dict(saved["weights"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    optimizer.load_state_dict(copy.deepcopy(saved["optimizer"]))
    losses = _train(model, optimizer, 0, 1, range(3, 6))
    return losses, model.state_dict()


def _assert_same_state(a: dict, b: dict) -> None:
    assert a["weights"].keys() == b["weights"].keys()
    for name in a["weights"]:
        assert torch.equal(a["weights"][name], b["weights"][name]), name
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    for index in sa:
        for key in sa[index]:
            assert torch.equal(torch.as_tensor(sa[index][key]), torch.as_tensor(sb[index][key])), (index, key)


@pytest.fixture(scope="module")
def saved_on(tmp_path_factory):
    """A checkpoint written by 2 ranks and one by 4 (three steps each), with the state they held."""
    made = {}

    def get(world: int) -> tuple[str, dict]:
        if world not in made:
            path = str(tmp_path_factory.mktemp(f"saved{world}") / "good")
            made[world] = (path, run_ranks(_save_case, world, path)[0])
        return made[world]

    return get


@pytest.mark.parametrize("saved_world, loaded_on", [(2, 1), (2, 4), (4, 2)])
def test_checkpoint_reshards_and_training_continues_at_parity(saved_on, saved_world, loaded_on):
    path, saved = saved_on(saved_world)
    files = sorted(p.name for p in Path(path).iterdir())
    assert assert_sharded_layout(files, saved_world) == saved["groups"]  # one file per flat group and rank
    reference_losses, reference_weights = _reference(saved)
    results = run_ranks(_load_case, loaded_on, path)
    global_losses = torch.tensor([r["losses"] for r in results]).mean(0).tolist()  # equal local batches
    for ours, theirs in zip(global_losses, reference_losses):
        assert abs(ours - theirs) <= 1e-5 * abs(theirs)
    for result in results:
        assert result["extra"] == {"step": 3}
        _assert_same_state(result["loaded"], saved)  # bitwise: weights and optimizer state intact
        for name, value in reference_weights.items():
            assert torch.allclose(result["weights"][name], value, rtol=0, atol=5e-5), (
                name, float((result["weights"][name] - value).abs().max()))


# -- damage ---------------------------------------------------------------------------------------


def _load_error_case(rank: int, world: int, path: str, cfg: GPTConfig) -> str:
    model, engine, optimizer = _sharded(seed=1, cfg=cfg)
    try:
        load_sharded_checkpoint(Path(path), engine, [optimizer])
    except (CheckpointError, CheckpointMismatchError, UnsafeCheckpointError) as error:
        return str(error)
    return "loaded"


def test_truncated_mismatched_and_tampered_checkpoints_fail_naming_the_problem(tmp_path, saved_on):
    good = Path(saved_on(2)[0])

    truncated = tmp_path / "truncated"
    shutil.copytree(good, truncated)
    shard = truncated / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    message = _load_error_case(0, 1, str(truncated), CFG)
    assert "__1_0.distcp" in message and "truncated" in message

    wider = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=48)
    message = _load_error_case(0, 1, str(good), wider)
    assert "does not fit this model" in message and "shape differs" in message and "wte.weight" in message

    incomplete = tmp_path / "incomplete"
    shutil.copytree(good, incomplete)
    (incomplete / "zero3.json").unlink()
    assert "incomplete" in _load_error_case(0, 1, str(incomplete), CFG)

    # metadata that would run a command when unpickled, sizes made to fit and the checksums dropped (as a
    # checkpoint from before checksums has none; checksums catch damage, not an attacker who rewrites them)
    tampered = tmp_path / "tampered"
    shutil.copytree(good, tampered)
    (tampered / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    manifest = json.loads((tampered / "zero3.json").read_text())
    manifest["files"][".metadata"] = (tampered / ".metadata").stat().st_size
    del manifest["checksums"]
    (tampered / "zero3.json").write_text(json.dumps(manifest))
    message = _load_error_case(0, 1, str(tampered), CFG)
    assert "refuses" in message and "posix.system" in message


def _pickled_object_case(rank: int, world: int, path: str) -> str:
    model, engine, optimizer = _sharded(seed=0)
    extra = {"hyper_parameters": {"cfg": CFG}}  # a dataclass: weights-only loading refuses it
    save_sharded_checkpoint(Path(path), engine, [optimizer], extra)
    try:
        load_sharded_checkpoint(Path(path), engine, [optimizer])
    except CheckpointError as error:
        return str(error)
    return "loaded"


def test_python_objects_in_the_trainer_state_are_refused_with_the_way_out(tmp_path):
    message = _pickled_object_case(0, 1, str(tmp_path / "ckpt"))
    assert "weights-only" in message and "GPTConfig" in message and "add_safe_globals" in message


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo this must never run",))


_KILL_SCRIPT = """
import os, signal, sys
sys.path[:0] = {paths!r}
from pathlib import Path
import lightning_zero3.checkpoint.api as api
import test_checkpoint as t
from distributed import run_ranks
real = api.save_pieces
def save_then_die(*args):
    real(*args)
    os.kill(os.getpid(), signal.SIGKILL)  # every rank dies after writing its pieces, before the manifest
api.save_pieces = save_then_die
t._save_case(0, 1, {path!r})
"""


def test_a_save_killed_midway_leaves_the_previous_checkpoint_valid(tmp_path, saved_on):
    path = tmp_path / "good"
    shutil.copytree(saved_on(2)[0], path)  # a good checkpoint of this name (saved on 2 ranks)
    before = _load_case(0, 1, str(path))["loaded"]  # one rank: in this process
    here = Path(__file__).resolve().parent
    paths = [str(here), str(here.parent / "helpers"), str(here.parents[1] / "examples")]
    script = _KILL_SCRIPT.format(paths=paths, path=str(path))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    partials = list(tmp_path.glob(".good.partial-*"))
    assert len(partials) == 1 and any(partials[0].glob("*.distcp"))  # the interrupted save is recognisable
    assert "incomplete" in _load_error_case(0, 1, str(partials[0]), CFG)
    after = _load_case(0, 1, str(path))["loaded"]
    _assert_same_state(after, before)  # the previous checkpoint is untouched
    _save_case(0, 1, str(path))  # the next save of the name clears the leftover
    assert not list(tmp_path.glob(".good.partial-*"))


# -- integrity: checksums, failed saves, non-finite states --------------------------------------------


def flip_bytes(file: Path, count: int = 64) -> None:
    """Invert ``count`` bytes in the middle of ``file``: the same size, other bytes (what a bad disk does)."""
    data = bytearray(file.read_bytes())
    count = min(count, len(data))
    start = (len(data) - count) // 2
    data[start : start + count] = bytes(b ^ 0xFF for b in data[start : start + count])
    file.write_bytes(bytes(data))


FLIPPED = ["__0_1.distcp", "__1_0.distcp", ".metadata", "trainer_state.pt"]  # shards of each rank, and shared files


@pytest.fixture(scope="module")
def corrupted(saved_on, tmp_path_factory):
    """Copies of the 2-rank checkpoint, each with 64 bytes flipped in one file."""
    good, base = Path(saved_on(2)[0]), tmp_path_factory.mktemp("corrupted")
    made = {}
    for name in FLIPPED:
        made[name] = base / name.strip("._")
        shutil.copytree(good, made[name])
        flip_bytes(made[name] / name)
    return made


def _poisoned_save_case(rank: int, world: int, corrupted: dict, out: str) -> dict:
    """Every corrupted checkpoint loaded on 2 ranks; then a save whose state holds NaN on rank 1 only."""
    messages = {name: _load_error_case(rank, world, str(path), CFG) for name, path in corrupted.items()}
    model, engine, optimizer = _sharded(seed=0)
    _train(model, optimizer, rank, world, range(1))
    poisoned = None
    if rank == 1:
        slot = next(s for s in engine.slots.values() if s.shard_param.numel())
        with torch.no_grad():
            slot.shard_param.view(-1)[0] = float("nan")
        poisoned = param_names(engine)[id(slot.shard_param)]
    try:
        save_sharded_checkpoint(Path(out) / "nan", engine, [optimizer], {"global_step": 7})
        refused = "saved"
    except NonFiniteCheckpointError as error:
        refused = str(error)
    left = sorted(p.name for p in Path(out).iterdir())
    engine.config = dataclasses.replace(engine.config, save_non_finite=True)
    save_sharded_checkpoint(Path(out) / "nan", engine, [optimizer], {"global_step": 7})
    # a single-file checkpoint (checkpoint_format="full") with bytes flipped inside its largest tensor
    full = Path(out) / "full" / "state.ckpt"
    save_full_checkpoint(full, engine, [optimizer], {"global_step": 7})
    intact = load_file_checkpoint(full, engine.comm)["state_dict"]
    engine.comm.all_gather_objects(None)  # both ranks read it before rank 0 damages it
    if rank == 0:
        flip_record(full)
    engine.comm.all_gather_objects(None)
    try:
        load_file_checkpoint(full, engine.comm)
        full_refused = "loaded"
    except CheckpointError as error:
        full_refused = str(error)
    return {"messages": messages, "poisoned": poisoned, "refused": refused, "left": left,
            "full_intact": sorted(intact) == sorted(engine.module.state_dict()), "full_refused": full_refused}  # fmt: skip


def flip_record(file: Path) -> str:
    """Flip 64 bytes in the middle of the largest record of a zip (``torch.save``) file; its name."""
    with zipfile.ZipFile(file) as archive:
        info = max(archive.infolist(), key=lambda i: i.file_size)
    data = bytearray(file.read_bytes())
    header = info.header_offset
    start = header + 30 + int.from_bytes(data[header + 26 : header + 28], "little") + int.from_bytes(data[header + 28 : header + 30], "little")
    middle = start + info.file_size // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    file.write_bytes(bytes(data))
    return info.filename


def test_flipped_bytes_in_sharded_and_full_checkpoints_and_non_finite_states_are_refused_on_every_rank(corrupted, tmp_path):
    results = run_ranks(_poisoned_save_case, 2, corrupted, str(tmp_path))
    for rank, result in enumerate(results):
        for name, message in result["messages"].items():
            reader = int(name[2]) if name.endswith(".distcp") else 0  # each file is checked by one rank
            assert f"{corrupted[name] / name}: rank {reader} read it" in message, (rank, message)
            assert "is corrupt; nothing was loaded" in message and message.count("checksum") == 1
            expected = json.loads((corrupted[name] / "zero3.json").read_text())["checksums"]["files"][name]
            assert f"written with {expected}" in message
        # a NaN in one weight on rank 1: both ranks refuse the save, naming the tensor, the step and the way out
        poisoned = results[1]["poisoned"]
        refused = result["refused"]
        assert f"model.{poisoned} holds 1 non-finite value" in refused and "at step 7" in refused, refused
        assert "found by rank 1" in refused and "save_non_finite=True" in refused and "was removed" in refused
        assert result["left"] == []  # no partial directory
        # the full file: checked against its records' CRC-32 on both ranks before any weight changes
        assert result["full_intact"]
        full = tmp_path / "full" / "state.ckpt"
        assert f"{full} (its record " in result["full_refused"], result["full_refused"]
        assert "read it and found the crc32 checksum" in result["full_refused"] and "nothing was loaded" in result["full_refused"]
    kept = tmp_path / "nan"  # with `save_non_finite=True` the state is saved as it is
    weights = torch.load(consolidate_checkpoint(kept, tmp_path / "kept.pt"), weights_only=True)
    poisoned = {name for name, w in weights.items() if torch.isnan(w).any()}  # a tied weight under each name
    assert results[1]["poisoned"] in poisoned and all(int(torch.isnan(weights[n]).sum()) == 1 for n in poisoned)


def test_resharded_loads_and_consolidation_check_every_file(corrupted, tmp_path):
    for name, path in corrupted.items():
        message = _load_error_case(0, 1, str(path), CFG)  # saved on 2 ranks, loaded on 1: rank 0 reads all
        assert f"{path / name}: rank 0 read it" in message, message
        with pytest.raises(CheckpointError, match=f"{re.escape(str(path / name))}: found the xxh3_64 checksum"):
            consolidate_checkpoint(path, tmp_path / "out.pt")
        assert not (tmp_path / "out.pt").exists()


def _refused_loads_case(rank: int, world: int, paths: list[str], config: Zero3Config = CONFIG) -> list[dict]:
    """Each of the damaged checkpoints ``paths`` loaded into a model that has trained a step: the error of
    each, once this rank's weights and optimizer state are found to be what they were before it."""
    model, engine, optimizer = _sharded(seed=1, config=config)
    _train(model, optimizer, rank, world, range(1))
    before = {"weights": engine.full_state_dict(), "optimizer": engine.full_optimizer_state(optimizer)}
    results = []
    for path in paths:
        try:
            load_sharded_checkpoint(Path(path), engine, [optimizer])
            message = "loaded"
        except CheckpointError as error:
            message = str(error)
        after = {"weights": engine.full_state_dict(), "optimizer": engine.full_optimizer_state(optimizer)}
        _assert_same_state(after, before)  # nothing changed: the check came before any weight or state
        results.append({"message": message})
    engine.close()
    return results


def _assert_refused_everywhere(results: list[list[dict]], damaged: list[tuple[Path, str]]) -> None:
    """Every rank refused each damaged checkpoint with the same error, naming the file, its checker and
    both checksums."""
    for index, (path, name) in enumerate(damaged):
        messages = {result[index]["message"] for result in results}
        assert len(messages) == 1, messages  # the same error on every rank
        message = messages.pop()
        expected = json.loads((path / "zero3.json").read_text())["checksums"]["files"][name]
        found = rf"{re.escape(str(path / name))}: rank \d read it and found the xxh3_64 checksum"
        assert re.search(found, message), message
        assert f"written with {expected}" in message and "nothing was loaded" in message


def test_flipped_bytes_are_refused_on_every_rank_of_a_load_on_more_ranks_than_saved(corrupted):
    damaged = [(corrupted[name], name) for name in ("__0_1.distcp", "__1_0.distcp")]  # a shard of each saved rank
    _assert_refused_everywhere(run_ranks(_refused_loads_case, 4, [str(p) for p, _ in damaged]), damaged)


def flip_item(path: Path, key: str) -> str:
    """Flip 64 bytes in the middle of the stored bytes of the largest DCP item whose name contains ``key``;
    the name of the file holding them."""
    metadata = read_dcp_metadata(path)
    index = max((i for i in metadata.storage_data if key in i.fqn), key=lambda i: metadata.storage_data[i].length)
    stored = metadata.storage_data[index]
    file = path / stored.relative_path
    data = bytearray(file.read_bytes())
    middle = stored.offset + stored.length // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    file.write_bytes(bytes(data))
    return stored.relative_path


def test_flipped_bytes_in_a_checkpoint_saved_under_nvme_offload_are_refused_on_every_rank(tmp_path):
    # the states live in swap files: saved straight from them, and loaded straight into them after the check
    nvme = {"offload_optimizer": "nvme", "offload_params": "nvme", "nvme_path": str(tmp_path / "swap")}
    config = dataclasses.replace(CONFIG, **nvme)
    path = tmp_path / "nvme"
    run_ranks(_save_case, 2, str(path), config)
    damaged = [(path, flip_item(path, "exp_avg_sq"))]  # an optimizer state that lived only in its swap file
    _assert_refused_everywhere(run_ranks(_refused_loads_case, 2, [str(path)], config), damaged)


def test_a_changed_manifest_is_refused_and_a_checkpoint_without_checksums_loads_with_one_warning(tmp_path, saved_on):
    good = Path(saved_on(2)[0])
    changed = tmp_path / "changed"
    shutil.copytree(good, changed)
    text = (changed / "zero3.json").read_text()
    (changed / "zero3.json").write_text(text.replace('"shape": [\n    64', '"shape": [\n    65', 1))  # same size
    assert (changed / "zero3.json").read_text() != text
    message = _load_error_case(0, 1, str(changed), CFG)
    assert f"the manifest {changed / 'zero3.json'} is corrupt" in message and "xxh3_64 checksum" in message

    old = tmp_path / "old"  # as an earlier version wrote it: sizes, no checksums
    shutil.copytree(good, old)
    manifest = json.loads((old / "zero3.json").read_text())
    del manifest["checksums"]
    (old / "zero3.json").write_text(json.dumps(manifest))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = _load_case(0, 1, str(old))["loaded"]
    said = [str(w.message) for w in caught if "without checksums" in str(w.message)]
    assert len(said) == 1 and str(old) in said[0], [str(w.message) for w in caught]
    _assert_same_state(loaded, saved_on(2)[1])


def test_a_failed_save_removes_its_partial_directory_and_says_so(tmp_path, monkeypatch):
    from lightning_zero3.checkpoint import api

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(api, "write_manifest", fail)
    with pytest.raises(CheckpointError, match="its partial directory .*good.partial-.* was removed") as error:
        _save_case(0, 1, str(tmp_path / "good"))
    assert "No space left on device" in str(error.value)
    assert list(tmp_path.iterdir()) == []


def test_verify_command_checks_a_checkpoint_without_loading_it(corrupted, saved_on, capsys):
    assert cli_main(["verify", saved_on(2)[0]]) == 0
    assert "every file matches its checksum" in capsys.readouterr().out
    bad = corrupted["__1_0.distcp"]
    assert cli_main(["verify", str(bad)]) == 1
    out = capsys.readouterr().out
    assert f"BAD {bad / '__1_0.distcp'}: found the xxh3_64 checksum" in out and "1 problem(s)" in out


# -- consolidation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_consolidated_file_loads_into_a_plain_model(tmp_path, saved_on, fmt):
    path, state = saved_on(2)
    saved = state["weights"]
    out = tmp_path / f"model.{fmt}"
    consolidate_checkpoint(path, out)
    if fmt == "pt":
        weights = torch.load(out, weights_only=True)
    else:
        from safetensors.torch import load_file

        weights = load_file(out)
    plain = GPT(CFG)
    plain.load_state_dict(weights)  # strict: every name of the model, tied names included
    for name, value in plain.state_dict().items():
        assert torch.equal(value, saved[name]), name
    if fmt == "pt":  # a tied weight is stored once, under both names, as torch.save would
        assert weights["head.weight"].data_ptr() == weights["wte.weight"].data_ptr()
        assert zipfile.ZipFile(out).testzip() is None  # every record's CRC-32 is true


_MEASURE = """
import json, sys
from lightning_zero3.checkpoint.consolidate import main
def hwm(): return int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0]) * 1024
base = hwm()
main(sys.argv[1:])
print(json.dumps({"baseline": base, "peak": hwm()}))
"""


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_consolidation_streams_tensor_by_tensor(tmp_path, fmt):
    from lightning_zero3.checkpoint import FlatPiece

    tensors = {f"layer{i}.weight": torch.full((512, 1024), float(i)) for i in range(48)}  # 96 MiB, 2 MiB each
    state = {name: FlatPiece(t.reshape(-1), 0, t.numel(), tuple(t.shape)) for name, t in tensors.items()}
    write_sharded_checkpoint(tmp_path / "ckpt", Communicator(), state, [], {})
    out = tmp_path / f"model.{fmt}"
    done = subprocess.run([sys.executable, "-c", _MEASURE, str(tmp_path / "ckpt"), str(out)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"wrote {out}" in done.stdout
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    model_bytes = sum(t.numel() * 4 for t in tensors.values())
    assert figures["peak"] - figures["baseline"] < model_bytes / 4  # about the largest tensor, not the model
    if fmt == "pt":
        loaded = torch.load(out, weights_only=True)
    else:
        from safetensors.torch import load_file

        loaded = load_file(out)
    assert list(loaded) == list(tensors) and all(torch.equal(loaded[k], v) for k, v in tensors.items())
