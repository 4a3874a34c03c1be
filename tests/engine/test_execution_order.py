"""In-process checks (one rank, no process group) of the pieces that keep ranks in step: the reduction
queue's order, the schedule's trace changes, the gather tags and their error message, the watchdog."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from distributed import free_port
from routing_models import SkippingModel

from lightning_zero3 import Zero3Config, Zero3Engine
from lightning_zero3.engine.comm.agreement import ExecutionOrderError, OrderCheck
from lightning_zero3.engine.failure.watchdog import Watchdog
from lightning_zero3.engine.grads import reduction as grads


@pytest.fixture
def engine():
    torch.manual_seed(0)
    model = SkippingModel(layers=4)
    return model, Zero3Engine(model, Zero3Config(persistence_threshold=0, reduce_bucket_size=1, single_process_sharding=True))


def _units(engine):
    return {rt.name: rt for rt in engine.runtimes}


def test_reduction_order_follows_the_last_appearance_in_the_backward_trace_root_last(engine):
    _, engine = engine
    u = _units(engine)
    queue = engine.hooks.queue
    assert [rt.name for rt in queue.order_for([])] == ["blocks.3", "blocks.2", "blocks.1", "blocks.0", "<root>"]
    trace = [u["blocks.3"], u["blocks.1"], u["blocks.3"], u["blocks.0"]]  # blocks.3 twice, blocks.2 skipped
    assert [rt.name for rt in queue.order_for(trace)] == ["blocks.1", "blocks.3", "blocks.0", "blocks.2", "<root>"]


def test_a_unit_is_reduced_when_it_and_every_unit_before_it_are_over(engine, monkeypatch):
    _, engine = engine
    u = _units(engine)
    sent = []
    monkeypatch.setattr(grads, "reduce_packed", lambda packed, comm, async_op: sent.append([p.group.name for p in packed]))
    queue = engine.hooks.queue
    queue.begin([])  # reverse module order: blocks.3, blocks.2, blocks.1, blocks.0, root
    for name in ("blocks.1", "blocks.2"):  # over before blocks.3: they wait
        u[name].end_backward()
        queue.advance()
    assert sent == []
    u["blocks.3"].end_backward()
    queue.advance()
    assert sent == [["blocks.3"], ["blocks.2"], ["blocks.1"]]
    for runtime in engine.runtimes:  # backward ended (as the end-of-backward callback does): the rest, in order
        runtime.end_backward()
    queue.finish()
    assert sent[3:] == [["blocks.0"], ["<root>"]]


def test_flags_say_which_parameters_had_a_gradient_and_none_stays_none(engine):
    model, engine = engine
    block = _units(engine)["blocks.0"]
    model.blocks[0].fc.weight.grad = torch.ones(model.blocks[0].fc.weight.shape)
    packed = grads.pack_gradients(block.group, engine.comm)
    names = [slot.name for slot in block.group.trainable_slots]
    assert packed.used_here == [name == "blocks.0.fc.weight" for name in names]
    reduced = packed.buffer.reshape(-1).clone()  # one rank: the reduce-scatter is a copy
    grads._accumulate(packed, reduced)
    grads.restore_unused([packed], engine.comm)  # when backward ends: no rank used the others
    for slot in block.group.trainable_slots:
        assert (slot.shard_param.grad is not None) == (slot.name == "blocks.0.fc.weight"), slot.name


def test_only_a_unit_without_a_post_backward_signal_counts_its_gradients_by_hooks(engine):
    # [Note: counting a unit's gradients]: the blocks (fed the embeddings) end by their post-backward
    # signal and get no hook per parameter; the root, fed token ids, counts its parameters' gradients
    from routing_models import lm_loss

    from lightning_zero3.engine.layout.released import engine_access

    model, engine = engine
    u = _units(engine)
    tokens = torch.randint(0, 32, (2, 6))
    for _ in range(2):
        lm_loss(model(tokens), tokens).backward()
    with engine_access():
        hooked = {rt.name: [bool(slot.param._post_accumulate_grad_hooks) for slot in rt.group.trainable_slots] for rt in u.values()}
    assert hooked["<root>"] and all(hooked["<root>"])
    assert all(not any(flags) for name, flags in hooked.items() if name.startswith("blocks."))
    assert all(slot.shard_param.grad is not None for rt in u.values() for slot in rt.group.trainable_slots)


def test_a_gradient_reaching_a_unit_after_its_reduction_fails_when_backward_ends(engine):
    # blocks.0's weight also used before the model (gathered by hand): that gradient reaches it after
    # blocks.0's post-backward signal ended the unit and it was reduced; it is named, not dropped
    from routing_models import lm_loss

    from lightning_zero3 import gathered_parameters

    model, engine = engine
    tokens = torch.randint(0, 32, (2, 6))
    lm_loss(model(tokens), tokens).backward()
    weight = next(p for n, p in model.blocks[0].named_parameters() if n.endswith("weight") and p.dim() == 2)
    with gathered_parameters(model.blocks[0]):
        scale = weight.sum()
    model.blocks[0].register_forward_pre_hook(lambda module, args: (args[0] * scale,))
    with pytest.raises(ExecutionOrderError, match=r"blocks\.0\..*used outside its unit's forward"):
        lm_loss(model(tokens), tokens).backward()


def test_a_forward_whose_backward_never_came_does_not_keep_units_gathered_into_the_next(engine):
    # the root and the last block are kept from a forward into its backward; when the next forward starts
    # and that backward has not run, they go (this forward's memory is every step's), and training goes on
    from routing_models import lm_loss

    model, engine = engine
    u = _units(engine)
    tokens = torch.randint(0, 32, (2, 6))
    lm_loss(model(tokens), tokens).backward()  # the first step records the traces
    lm_loss(model(tokens), tokens)  # no backward
    assert u["<root>"].backward_hold and u["blocks.3"].backward_hold and u["blocks.3"].group.gathered
    seen = []
    model.blocks[0].register_forward_pre_hook(lambda *_: seen.append(u["blocks.3"].group.gathered), prepend=True)
    lm_loss(model(tokens), tokens).backward()
    assert seen == [False]  # released when the forward began, gathered again at its own start
    assert not any(rt.backward_hold for rt in engine.runtimes)
    assert all(slot.shard_param.grad is not None for slot in u["blocks.3"].group.trainable_slots)


def test_the_trace_is_re_recorded_when_the_order_changes_and_prefetch_follows_it(engine):
    model, engine = engine
    tokens = torch.randint(0, 32, (1, 5))
    for skip in (set(), set(), {2}, {2}, set()):
        model.skip = skip
        model(tokens).sum().backward()
    schedule = engine.schedule
    assert [rt.name for rt in schedule.traces["forward"]] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert schedule.steps == 5 and schedule.trace_changes == 2  # skip begins, skip ends
    assert engine.ledger.held["gathered_params"] == 0  # nothing prefetched for the old order is left
    before = schedule.prefetched
    model(tokens).sum().backward()  # the same order again: prefetch resumes
    assert schedule.prefetched > before and schedule.trace_changes == 2


def test_a_pass_that_stops_early_cuts_the_trace(engine):
    model, engine = engine
    tokens = torch.randint(0, 32, (1, 5))
    model(tokens).sum().backward()
    model.order = [0, 1]  # the last two blocks are not run: the trace ends sooner
    model(tokens).sum().backward()
    assert [rt.name for rt in engine.schedule.traces["forward"]] == ["blocks.0", "blocks.1"]
    assert engine.schedule.trace_changes == 1


def test_tags_name_what_each_rank_gathers():
    groups = [type("G", (), {"name": n, "full": torch.empty(10)})() for n in ("<root>", "blocks.0", "blocks.1")]
    check = OrderCheck(groups, comm=type("C", (), {"distributed": False})())
    check.enter("forward")
    tags = [check.tag([groups[1]]), check.tag([groups[2]])]
    assert tags[0][:6] == [0, 1, 1, 0, 10, 1] and tags[0] != tags[1]
    message = check._describe(tags)
    assert "['blocks.0', 'blocks.1']" in message and "forward of step 0 (pass 1)" in message
    assert "unit_modules" in message and "synced_gpus=True" in message
    assert isinstance(ExecutionOrderError(message), RuntimeError)


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", free_port(), 2, True, timeout=timedelta(seconds=10), wait_for_workers=False)


def _watch(store, ended: list, peer: str = "", beat: str = "0") -> Watchdog:
    """Rank 0's watchdog of a 2-rank job whose rank 1 is ``peer`` ("host pid"; default: this process)."""
    watchdog = Watchdog(store, rank=0, world_size=2, timeout=timedelta(seconds=4))
    store.set(watchdog.prefix + "where/1", peer or f"{watchdog.host} {os.getpid()}")
    store.set(watchdog.prefix + "hb/1", beat)
    watchdog.exit = lambda code: ended.append(code)
    watchdog.add_cleanup(lambda: ended.append("cleaned"))
    return watchdog.start()


def _wait_for(ended: list, seconds: float) -> None:
    """A liveness deadline, not a speed bound: returns as soon as the watchdog ended the rank, and the
    deadline is only how long the test waits before it says the watchdog never did. Each is at least 3x
    the time the watchdog needs by its design (``_watch``'s timeout of 4 s polls every 0.2 s)."""
    deadline = time.monotonic() + seconds
    while not ended and time.monotonic() < deadline:
        time.sleep(0.05)


def test_watchdog_ends_the_rank_when_a_peer_aborts(store, capfd):
    ended: list = []
    watchdog = _watch(store, ended)
    store.set(watchdog.prefix + "done/1", "1")  # rank 1 has gone through its teardown: nobody waits for it
    store.set(watchdog.prefix + "abort", "rank 1 failed: ValueError: boom")
    _wait_for(ended, 3)  # liveness: seen within one poll (0.2 s); 3 s is 15x
    watchdog.stop()
    assert ended, "the watchdog never ended the rank after its peer's abort"
    assert ended[:2] == ["cleaned", 1]  # swap folders first, then the exit
    assert "zero3: rank 0 stops because rank 1 failed: ValueError: boom" in capfd.readouterr().err


def test_watchdog_sees_a_killed_peer_of_this_host(store, capfd):
    ended: list = []
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    watchdog = _watch(store, ended, peer=f"{os.uname().nodename} {gone.pid}")
    _wait_for(ended, 3)  # liveness: seen within one poll (0.2 s); 3 s is 15x
    watchdog.stop()
    assert ended, "the watchdog never ended the rank after its peer's process died"
    assert f"rank 1 (process {gone.pid} on this host) ended without a word" in capfd.readouterr().err


def test_watchdog_leaves_a_peer_that_finished_alone(store):
    ended: list = []
    store.set(Watchdog(store, 0, 2, timedelta(seconds=4)).prefix + "done/1", "1")  # finished, so...
    watchdog = _watch(store, ended, peer=f"{os.uname().nodename} 999999999")  # ...no such process any more
    time.sleep(3 * watchdog.interval)
    watchdog.stop()
    assert ended == []


def test_watchdog_sees_a_stale_heartbeat(store, capfd):
    ended: list = []
    watchdog = _watch(store, ended, peer="another-host 1", beat="7")  # timeout 4 s: stale after 2 s; it never beats
    _wait_for(ended, 8)  # liveness: stale after 2 s, seen within two polls more (2.4 s); 8 s is over 3x
    watchdog.stop()
    assert ended, "the watchdog never ended the rank whose peer's heartbeat stopped"
    assert "rank 1 (on another-host) sent no heartbeat" in capfd.readouterr().err


def test_the_first_abort_wins_and_the_same_error_everywhere_is_no_news(store):
    watchdog = Watchdog(store, rank=0, world_size=2, timeout=timedelta(seconds=4))
    store.set(watchdog.prefix + "abort", "rank 1 failed: CheckpointError: disk full")
    assert watchdog.abort("CheckpointError: disk full") is None
    assert watchdog.abort("RuntimeError: Connection closed by peer") == "rank 1 failed: CheckpointError: disk full"
