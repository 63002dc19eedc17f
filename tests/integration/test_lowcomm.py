"""The low-communication mode (``--local_steps``) on 127.0.0.1, every node its own process, in one swarm.

Timeline. The monitor M starts and saves checkpoints; trainers A, B and C join through it. Once all three have
passed global epoch KILL_AFTER, C is killed with SIGKILL as its pseudo-gradient round begins; A and B must go on
within a bound. A newcomer D, started once the others have trained an epoch, joins mid-run (it downloads anchor,
outer momentum and Lamb state); D is a torchrun peer of two ranks that shard its model (``--shard_model``).
The inner learning rate decays to 0 at MAX_STEPS (--total_steps); A, B and D are stopped (SIGTERM) once their events
show a complete parameter round of all three after it, and their saved models are compared: they must hold one model
(apart by a small fraction of the distance it travelled), not agree to fp16 precision as synchronous peers do: 0.1 %
of that distance once parameter rounds averaged the outer momentum too, up to 7 % before
(docs/benchmarks/2026-11-30-intel-xeon-2core-outer-momentum.md). Afterwards a new trainer resumes from M's last
checkpoint.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from collab.checkpoint import list_checkpoints
from tests.integration.agreement import (
    assert_ranks_agree,
    assert_same_trajectory,
    evened_out,
    rank_checksums,
    saved_parameters,
)
from trainer.local import TORCHRUN, LocalProcess, MonitorProcess, PeerProcess, free_port, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

KILL_AFTER = 2
MAX_STEPS = 8
STEP_CAP = MAX_STEPS + 20  # --max_steps: a bound should the stop below never come
AVERAGING_TIMEOUT = 15
LOCAL_STEPS = 2
LOWCOMM = [
    *("--local_steps", str(LOCAL_STEPS), "--target_batch_size", "128", "--matchmaking_time", "1.5"),
    # the schedule counts global batches of 128 samples, LOCAL_STEPS to an outer round (a global epoch here)
    *("--averaging_timeout", str(AVERAGING_TIMEOUT), "--total_steps", str(MAX_STEPS * LOCAL_STEPS)),
    *("--average_state_every", "2"),  # the agreement checked below comes from parameter rounds
    # the rate the low-communication loss runs train at (bench.wan): at the default 0.2 the outer step's momentum
    # overshot, and the swarm's loss rose again from the fifth epoch, past its start after a kill's partial rounds
    *("--learning_rate", "0.05"),
]
D_BATCH = 8  # D's samples per mini-step on each of its two ranks
D_FLAGS = ["--shard_model", "--per_device_train_batch_size", str(D_BATCH)]


@dataclass
class Swarm:
    out: Path
    prefix: str
    peers: dict[str, LocalProcess]
    monitor: LocalProcess
    exit_codes: dict[str, int]
    epoch_when_c_died: int
    seconds_to_two_more_epochs: float


def epochs_of(peer: LocalProcess) -> list[int]:
    return [record["epoch"] for record in peer.events("epoch")]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory, sample_data):
    out = tmp_path_factory.mktemp("lowcomm")
    prefix = f"lowcomm{int(time.time())}"
    common = ["--experiment_prefix", prefix, *LOWCOMM]
    monitor = MonitorProcess(
        [
            *common,
            *("--host_maddrs", f"/ip4/127.0.0.1/tcp/{free_port()}", "--refresh_period", "1"),
            *("--store_checkpoints", "--repo_path", str(out / "checkpoints"), "--save_checkpoint_step_interval", "2"),
        ],
        out / "M.log",
    )
    peers: dict[str, LocalProcess] = {}
    try:
        join = monitor.join_flags(timeout=120)
        for name in "ABC":
            argv = [*common, *join, "--output_dir", str(out / name)]
            peers[name] = PeerProcess(
                [*argv, *(["--max_steps", str(STEP_CAP)] if name != "C" else [])], out / f"{name}.log"
            )
        # D starts while the others train, so that it joins mid-run whatever its start-up takes
        wait_until(lambda: all(epochs_of(peer) for peer in peers.values()), 240, "A, B and C to finish an epoch")
        peers["D"] = PeerProcess(
            [*common, *join, *D_FLAGS, "--max_steps", str(STEP_CAP), "--output_dir", str(out / "D")],
            out / "D.log",
            launcher=(*TORCHRUN, "--nproc_per_node", "2"),
        )
        wait_until(
            lambda: all(max(epochs_of(peers[name]), default=-1) >= KILL_AFTER for name in "ABC"),
            120,
            f"A, B and C to pass epoch {KILL_AFTER}",
        )
        c_rounds = len(peers["C"].events("step_begun"))
        wait_until(lambda: len(peers["C"].events("step_begun")) > c_rounds, 60, "C's next round to begin", poll=0.05)
        peers["C"].crash()
        killed_at, epoch_when_c_died = time.monotonic(), max(epochs_of(peers["A"]))
        wait_until(
            lambda: min(max(epochs_of(peers[name])) for name in "AB") >= epoch_when_c_died + 2,
            AVERAGING_TIMEOUT + 60,
            "A and B to pass two more epochs without C",
        )
        seconds = time.monotonic() - killed_at
        stopping = [peers[name] for name in "ABD"]
        wait_until(
            lambda: all(evened_out(peer, 3, MAX_STEPS + 1) for peer in stopping),
            300,
            "A, B and D to average their parameters together at inner learning rate 0",
        )
        for name in "AB":
            peers[name].process.send_signal(signal.SIGTERM)
        d_rank_0 = peers["D"].rank_pid(0)
        assert d_rank_0 is not None, "no process of D has RANK=0"
        os.kill(d_rank_0, signal.SIGTERM)  # rank 0 stops D's ranks; torchrun itself exits 1 on SIGTERM
        exit_codes = {name: peers[name].wait(timeout=120) for name in "ABD"}
        wait_until(
            lambda: any(m.step >= MAX_STEPS - 2 for _, m in list_checkpoints(out / "checkpoints")[0]),
            60,
            "the monitor's checkpoint of a late epoch",
        )
        yield Swarm(out, prefix, peers, monitor, exit_codes, epoch_when_c_died, seconds)
    finally:
        for process in [*peers.values(), monitor]:
            process.close()


def test_peers_stop_cleanly_and_their_loss_falls(swarm):
    assert swarm.exit_codes == {"A": 0, "B": 0, "D": 0}
    for name in "ABD":
        assert MAX_STEPS < max(epochs_of(swarm.peers[name])) < STEP_CAP, name
        assert not swarm.peers[name].tracebacks_from_our_code(), name
    # the schedule ends at MAX_STEPS; the epochs after it only wait for a full parameter round
    losses = [record["loss"] for record in swarm.peers["A"].events("epoch") if record["epoch"] <= MAX_STEPS]
    assert losses[-1] < losses[0] - 0.5, f"A's loss did not fall: {losses}"


def test_pseudo_gradients_are_averaged_in_groups(swarm):
    rounds = [r for r in swarm.peers["A"].events("averaged") if r["kind"] == "pseudo-gradients"]
    assert any(r["group_size"] >= 3 for r in rounds), "A never averaged with both B and C"
    assert len(rounds) >= MAX_STEPS // 2


def test_a_killed_peer_does_not_stall_the_others(swarm):
    assert swarm.seconds_to_two_more_epochs < AVERAGING_TIMEOUT + 45


def test_a_newcomer_downloads_the_state_and_agrees_with_the_others(swarm):
    d = swarm.peers["D"]
    assert min(epochs_of(d)) > 1, "D did not start from the swarm's epoch"
    assert d.events("state_loaded"), "D did not download the state"
    # D is one peer on two ranks that shard its model: both ranks' samples count, and every epoch's inner steps
    # started from rank 0's parameters on both
    d_epochs = d.events("epoch")
    assert all(e["samples"] == e["mini_steps"] * 2 * D_BATCH for e in d_epochs), d_epochs
    both = rank_checksums(d, 0).keys() & rank_checksums(d, 1).keys()
    assert len(both) >= 3, both
    assert_ranks_agree(d, both)
    assert {record["sharded"] for rank in (0, 1) for record in d.rank_events(rank, "ranks_synced")} == {True}
    a = saved_parameters(swarm.out / "A")
    for name in "BD":
        assert_same_trajectory(a, saved_parameters(swarm.out / name), f"A and {name}", fraction=0.05)


def test_the_monitors_checkpoint_resumes_a_trainer(swarm, tmp_path):
    folder, manifest = list_checkpoints(swarm.out / "checkpoints")[0][-1]
    peer = PeerProcess(
        [
            *("--experiment_prefix", f"resume{swarm.prefix}", *LOWCOMM, "--resume_from", str(folder)),
            *(
                "--target_batch_size",
                "16",
                "--max_steps",
                str(manifest.step + 1),
                "--output_dir",
                str(tmp_path / "out"),
            ),
        ],
        tmp_path / "resume.log",
    )
    try:
        assert peer.wait(timeout=180) == 0
    finally:
        peer.stop()
    assert [(r["path"], r["epoch"]) for r in peer.events("resumed")] == [(str(folder), manifest.step)]
    assert not peer.tracebacks_from_our_code()
