"""Ranks that issue different collectives, and SIGTERM while ranks wait, end every rank with one message
(2 ranks, ``scripts/hangs_run.py``; ``hang_timeout`` is 2 s there). The deadlines below are liveness
deadlines, three times or more what a run takes (about 3-5 s from the mismatch here, and about 25-35 s
under the default 20 s ``hang_timeout``); they say "it ends", not how fast."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
from distributed import free_port
from lightning_zero3.engine.failure.watchdog import process_alive

from lightning_zero3 import Zero3Config
from lightning_zero3.engine.failure.hang_check import HANG, HangCheck
from lightning_zero3.errors import Zero3ConfigError

SCRIPT = Path(__file__).parents[1] / "scripts" / "hangs_run.py"
MISMATCH_DEADLINE_S = 20  # liveness deadline: hang_timeout 2 s + polls + exit take about 3-5 s
SIGTERM_DEADLINE_S = 15  # liveness deadline: the ranks end about 1 s after the signal
MISMATCHES = ["save_rank0", "export_rank0", "skip_backward", "fabric_save"]
SIGTERMS = ["sigterm_rank0", "sigterm_rank1"]


def _environment() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    return {**env, "PYTHONWARNINGS": "ignore"}


def _record(out: Path, rank: int) -> dict:
    try:
        return json.loads((out / f"rank{rank}.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}


def launch_mismatch(case: str, out: Path) -> dict:
    """Both ranks, started as torchrun would (so that each one's exit status and time are seen)."""
    out.mkdir(parents=True)
    env = {**_environment(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "NODE_RANK": "0"}  # fmt: skip
    ranks = []
    for rank in range(2):
        stderr = open(out / f"stderr{rank}.txt", "w")
        process = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--case", case, "--out", str(out)],
            env={**env, "LOCAL_RANK": str(rank), "RANK": str(rank)}, stdout=subprocess.DEVNULL, stderr=stderr,
        )  # fmt: skip
        ranks.append((process, stderr))
    ended = _wait_for_exits([process for process, _ in ranks], 120)
    for process, stderr in ranks:
        stderr.close()
    fault_time = min(r["fault_time"] for r in (_record(out, 0), _record(out, 1)) if "fault_time" in r)
    return {
        "codes": [process.returncode for process, _ in ranks],
        "stderr": [(out / f"stderr{r}.txt").read_text() for r in range(2)],
        "seconds": [ended[r] - fault_time if r in ended else None for r in range(2)],
    }


def launch_sigterm(case: str, out: Path) -> dict:
    """One process, as a user starts a job: Lightning's launcher starts rank 1 as its child. Once both ranks
    wait in different collectives (for ever: ``hang_timeout`` is off), SIGTERM to rank 0 (the launching
    process) or to rank 1 only."""
    out.mkdir(parents=True)
    stderr = open(out / "stderr.txt", "w")
    process = subprocess.Popen([sys.executable, str(SCRIPT), "--case", "sigterm", "--out", str(out)],
                               env=_environment(), stdout=subprocess.DEVNULL, stderr=stderr)  # fmt: skip
    deadline = time.time() + 120
    while time.time() < deadline and not all(_record(out, r).get("waiting") for r in range(2)):
        time.sleep(0.1)
    time.sleep(0.5)  # both inside their collective's wait
    pids = [_record(out, r).get("pid") for r in range(2)]
    swap = sorted(p.name for p in (out / "nvme").glob("lightning_zero3-*/*"))
    target = pids[0] if case == "sigterm_rank0" else pids[1]
    sent = time.time()
    if target is not None:
        os.kill(target, signal.SIGTERM)
    _wait_for_exits([process], 60)
    gone = time.time()
    while time.time() < sent + 60 and any(pid and process_alive(pid) for pid in pids):
        time.sleep(0.05)
        gone = time.time()
    stderr.close()
    for pid in pids:  # left behind: a failure of the test, clean up first
        if pid and process_alive(pid):
            os.kill(pid, signal.SIGKILL)
    return {"code": process.returncode, "pids": pids, "swap_before": swap, "seconds": gone - sent,
            "swap_after": sorted(p.name for p in (out / "nvme").glob("lightning_zero3-*/*")),
            "stderr": (out / "stderr.txt").read_text()}  # fmt: skip


def _wait_for_exits(processes: list, limit: float) -> dict[int, float]:
    ended: dict[int, float] = {}
    deadline = time.time() + limit
    while len(ended) < len(processes) and time.time() < deadline:
        for index, process in enumerate(processes):
            if index not in ended and process.poll() is not None:
                ended[index] = time.time()
        time.sleep(0.05)
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()
    return ended


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case, two at a time (independent jobs)."""
    base = tmp_path_factory.mktemp("hangs")

    def one(case: str) -> dict:
        return (launch_sigterm if case.startswith("sigterm") else launch_mismatch)(case, base / case)

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(MISMATCHES + SIGTERMS, pool.map(one, MISMATCHES + SIGTERMS)))


# words every rank's message holds
EXPECTED = {
    "save_rank0": [HANG, "rank 0: training step 2 > training_step > Trainer.save_checkpoint", "rank 1: training step 2",
                   "call `trainer.save_checkpoint` on every rank"],
    "export_rank0": [HANG, "rank 0: training step 2 > training_step > save_full_weights", "rank 1: training step 2",
                     "call `save_full_weights` on every rank"],
    "fabric_save": [HANG, "rank 0: fabric.save", "rank 1:", "call `fabric.save`"],
}  # fmt: skip


@pytest.mark.parametrize("case", MISMATCHES)
def test_ranks_that_issue_different_collectives_all_end_with_one_message(runs, case):
    result = runs[case]
    for rank in range(2):
        code, stderr, seconds = result["codes"][rank], result["stderr"][rank], result["seconds"][rank]
        assert code not in (0, None), (rank, stderr[-3000:])
        assert seconds is not None and seconds < MISMATCH_DEADLINE_S, (rank, seconds, stderr[-3000:])
        if case == "skip_backward":  # refused at once on the rank that skips; its peer is told why
            assert "Skipping the `training_step` by returning None" in stderr, (rank, stderr[-3000:])
            continue
        messages = [line for line in stderr.splitlines() if line.startswith(f"zero3: rank {rank} stops because")]
        assert len(messages) == 1, (rank, stderr[-3000:])
        for words in EXPECTED[case]:
            assert words in messages[0], (rank, words, messages[0])
        assert "Traceback" not in stderr, (rank, stderr[-3000:])  # the message, not gloo's error


@pytest.mark.parametrize("case", SIGTERMS)
def test_sigterm_ends_every_rank_while_they_wait(runs, case):
    result = runs[case]
    assert None not in result["pids"], result["stderr"][-3000:]
    assert result["code"] in (143, -signal.SIGTERM), result["stderr"][-3000:]  # says: terminated
    assert result["seconds"] < SIGTERM_DEADLINE_S, result
    assert not any(process_alive(pid) for pid in result["pids"])
    assert len(result["swap_before"]) == 2 and result["swap_after"] == [], result  # swap folders removed
    terminated = 0 if case == "sigterm_rank0" else 1
    assert f"zero3: rank {terminated} stops because this rank was terminated by SIGTERM" in result["stderr"]
    assert f"zero3: rank {1 - terminated} stops because rank {terminated} was terminated by SIGTERM" in result["stderr"]


# -- the judgement itself, in process ------------------------------------------------------------------


def record(issued: dict, blocked=None, phases=("training step 1",)) -> dict:
    return {"issued": issued, "blocked": blocked, "phases": list(phases), "fixes": []}


def judge(records: dict, polls: list[float], idle_timeout=None) -> list:
    check = HangCheck(0, len(records), timeout=20.0, idle_timeout=idle_timeout)
    verdicts = []
    for now in polls:
        texts = {rank: json.dumps(r) for rank, r in records.items()}
        check.observe(texts, records, now)
        verdicts.append(check.verdict(records, now))
    return verdicts


def test_a_slow_collective_that_every_rank_issued_is_not_a_hang():
    # rank 0 has waited 10 minutes in all-gather #5 on the job group; rank 1 issued it too (and waits in a
    # reduce-scatter that rank 0 issued): slow, not mismatched
    records = {
        0: record({"job": 5, "reduce": 3}, ["job", 5, "all-gather", "", None]),
        1: record({"job": 5, "reduce": 3}, ["reduce", 3, "reduce-scatter", "", None]),
    }
    assert judge(records, [0.0, 300.0, 600.0]) == [None, None, None]


def test_ranks_waiting_on_each_other_in_different_collectives_are_a_hang_after_the_timeout_and_two_polls():
    records = {
        0: record({"world": 11}, ["world", 11, "broadcast", "", None], ["Trainer.save_checkpoint"]),
        1: record({"world": 10, "check": 14}, ["check", 14, "order check", "", None]),
    }
    verdicts = judge(records, [0.0, 10.0, 21.0, 22.0])
    assert verdicts[:3] == [None, None, None]
    assert verdicts[3] is not None and "rank 0: Trainer.save_checkpoint" in verdicts[3] and "rank 1:" in verdicts[3]


def test_the_same_collective_with_different_ops_is_a_hang():
    records = {
        0: record({"world": 11}, ["world", 11, "broadcast", "", None]),
        1: record({"world": 11}, ["world", 11, "barrier", "", None]),
    }
    assert judge(records, [0.0, 21.0, 22.0])[-1] is not None


def test_a_peer_that_computes_is_waited_for_unless_idle_outside_the_waiting_ranks_phase():
    waiting = record({"job": 5}, ["job", 5, "all-gather", "", None], ["training step 3"])
    computing = record({"job": 4}, None, ["training step 3"])  # the same phase: slow work, never a hang
    assert judge({0: waiting, 1: computing}, [0.0, 400.0, 401.0], idle_timeout=300.0)[-1] is None
    elsewhere = record({"job": 4}, None, ["validation step"])  # another phase, idle past the limit
    assert judge({0: waiting, 1: elsewhere}, [0.0, 400.0, 401.0], idle_timeout=300.0)[-1] is not None
    assert judge({0: waiting, 1: elsewhere}, [0.0, 400.0, 401.0], idle_timeout=None)[-1] is None


def test_hang_settings_take_durations_or_seconds_and_refuse_the_rest():
    assert Zero3Config(hang_timeout=5).hang_timeout == timedelta(seconds=5)
    assert Zero3Config(hang_timeout=None, hang_idle_timeout=None).hang_timeout is None
    for bad in (0, -1, "20s", True):
        with pytest.raises(Zero3ConfigError, match="hang_timeout"):
            Zero3Config(hang_timeout=bad)


def test_sigterm_is_seen_by_the_watchdog_thread_and_told_to_the_other_ranks(capfd):
    import torch.distributed as dist
    from lightning_zero3.engine.failure.watchdog import Watchdog

    store = dist.TCPStore("127.0.0.1", free_port(), 2, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    watchdog = Watchdog(store, rank=0, world_size=2, timeout=timedelta(seconds=4))
    store.set(watchdog.prefix + "where/1", f"{watchdog.host} {os.getpid()}")
    ended: list = []
    watchdog.exit = lambda code: ended.append(code)
    watchdog.add_cleanup(lambda: ended.append("cleaned"))
    watchdog.start()
    try:
        store.set(watchdog.prefix + "seen/1", "1")  # the peer has seen it and is done with the store
        store.set(watchdog.prefix + "left/1", "1")
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not ended and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        watchdog.stop()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # given back
    assert ended[:2] == ["cleaned", 143]
    assert store.get(watchdog.prefix + "abort").decode().startswith("rank 0 was terminated by SIGTERM")
    assert "zero3: rank 0 stops because this rank was terminated by SIGTERM" in capfd.readouterr().err
