"""One peer on two ranks (``torchrun --nproc_per_node 2``, gloo on CPU) trains with a plain peer on 127.0.0.1.

Timeline. The plain peer A starts; the torchrun peer T joins it. Once T's ranks have started SYNCED_EPOCHS global
epochs together, T gets SIGTERM: rank 0 must save the model and T exit within SHUTDOWN_BOUND seconds. A second
torchrun peer U then joins (it downloads the state) and, once its ranks have started SYNCED_EPOCHS epochs, U's rank 1
is killed with SIGKILL: U must exit non-zero within EXIT_BOUND seconds, and A must step on without it.
U shards its model across its ranks (``--shard_model``, FSDP on gloo). Throughout, the swarm must have seen two peers
(A's rounds), T's and U's epochs must count both ranks' samples, and each peer's ranks must have started every
epoch with the same parameters (their ``ranks_synced`` checksums; for U, rank 0's whole host model and what rank 1's
shards assemble to).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.integration.agreement import assert_ranks_agree, rank_checksums
from trainer.local import TORCHRUN, LocalProcess, PeerProcess, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(480)]  # 82 s measured on 2 cores; 159 s under load 11

BATCH = 8  # --per_device_train_batch_size: each rank's samples per mini-step
SETTINGS = [
    *("--target_batch_size", "128", "--matchmaking_time", "1", "--averaging_timeout", "15"),
    *("--per_device_train_batch_size", str(BATCH)),
]
# A newcomer's parameters may start three epochs in a row unchanged: a step's update lands one step late (delayed
# optimizer step), and a peer that finds the swarm one epoch past its load enters that epoch without a step. A fourth
# epoch shows them moved.
SYNCED_EPOCHS = 4
SHUTDOWN_BOUND = 60  # seconds from SIGTERM to torchrun's exit: rank 0's clean shutdown (deadline 25 s), then the rest
EXIT_BOUND = 60  # seconds from SIGKILL of a rank to the peer's exit: torchrun stops the others, gloo sees it gone
TWO_RANKS = (*TORCHRUN, "--nproc_per_node", "2")


def epochs_of_both_ranks(peer: LocalProcess) -> set[int]:
    return rank_checksums(peer, 0).keys() & rank_checksums(peer, 1).keys()


def trained_together(peer: LocalProcess) -> set[int]:
    """The epochs both ranks of ``peer`` started with the same parameters, once they are SYNCED_EPOCHS and ``peer``
    has averaged its gradients with the plain peer (a newcomer's first rounds may miss their group: epochs of about
    1.5 s here can pass SYNCED_EPOCHS before one forms)."""

    def ready() -> set[int] | None:
        epochs = epochs_of_both_ranks(peer)
        return epochs if len(epochs) >= SYNCED_EPOCHS and 2 in peer.averaging_group_sizes() else None

    return wait_until(
        ready, 180, f"{peer.log_path.stem}'s two ranks to start {SYNCED_EPOCHS} epochs together and average with A"
    )


def test_torchrun_peers_train_with_a_plain_peer_stop_on_sigterm_and_exit_when_a_rank_dies(tmp_path, sample_data):
    common = ["--experiment_prefix", f"torchrun{int(time.time())}", *SETTINGS]
    a = PeerProcess([*common, "--output_dir", str(tmp_path / "A")], tmp_path / "A.log")
    peers = [a]
    try:
        join = a.join_flags(120)

        def torchrun_peer(name: str, *flags: str) -> LocalProcess:
            argv = [*common, *join, *flags, "--output_dir", str(tmp_path / name)]
            peers.append(PeerProcess(argv, tmp_path / f"{name}.log", launcher=TWO_RANKS))
            return peers[-1]

        t = torchrun_peer("T")
        t_epochs_synced = trained_together(t)
        t.process.send_signal(signal.SIGTERM)  # torchrun passes it on to every rank
        t.wait(timeout=SHUTDOWN_BOUND)

        u = torchrun_peer("U", "--shard_model")
        u_epochs_synced = trained_together(u)
        a_rounds = a.averaging_group_sizes()
        victim = u.rank_pid(1)
        assert victim is not None, "no process of U has RANK=1"
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        code = u.wait(timeout=EXIT_BOUND)
        exit_seconds, exited_at = time.monotonic() - killed_at, time.time()
        a.wait_for_event("epoch", 120, where=lambda record: record["time"] > exited_at)  # A steps on alone
    finally:
        for peer in peers:
            peer.close()

    # the swarm saw two peers at a time: a torchrun peer's ranks are one member of A's groups, never two
    assert a_rounds and set(a_rounds) == {2}, a_rounds
    # every mini-step of T counts both ranks' samples
    t_epochs = t.events("epoch")
    assert t_epochs and all(e["samples"] == e["mini_steps"] * 2 * BATCH for e in t_epochs), t_epochs
    assert_ranks_agree(t, t_epochs_synced)
    # SIGTERM: rank 0 saved the model it trained
    (shutdown,) = t.events("shutdown")
    assert shutdown["saved"] and shutdown["epoch"] >= t_epochs[-1]["epoch"], shutdown
    assert (tmp_path / "T" / "model.safetensors").exists()
    # U (--shard_model) started from the swarm's state: rank 1's shards assemble to rank 0's whole host model
    assert u.events("state_loaded") and min(u_epochs_synced) > 0, u_epochs_synced
    assert_ranks_agree(u, u_epochs_synced)
    assert {record["sharded"] for rank in (0, 1) for record in u.rank_events(rank, "ranks_synced")} == {True}
    assert {record["sharded"] for rank in (0, 1) for record in t.rank_events(rank, "ranks_synced")} == {False}
    u_epochs = u.events("epoch")
    assert u_epochs and all(e["samples"] == e["mini_steps"] * 2 * BATCH for e in u_epochs), u_epochs
    assert code != 0 and exit_seconds < EXIT_BOUND, (code, exit_seconds)
