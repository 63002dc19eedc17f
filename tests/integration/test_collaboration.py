"""A real collaboration on 127.0.0.1, every node its own process, as the README runs it, with faults.

Timeline. The monitor M starts first on a fixed port and identity; trainers A and B join through its address.
A is faulty (test faults: a NaN loss at epoch 3, NaN parameters at epoch 6) and must drop the batch and roll back.
C joins once the collaboration has passed global epoch 2. M is killed with SIGKILL in the middle of its second
checkpoint write and restarted with the same identity (M2). C contributes, then is killed with SIGKILL as an
averaging round begins, and restarts as C2. An outside client reads the metrics, a stranger forges records and
a peer with a valid signature publishes a NaN loss. The learning rate reaches 0 at global epoch MAX_STEPS
(total_steps), where B stops by itself; A and C2 have no max_steps and are stopped (SIGTERM) once B has stopped,
C2 has contributed and the monitor holds a checkpoint from after a parameter round at learning rate 0 that A and
C2 both completed in full (what partial rounds left apart is even from then on); its parameters are compared with
A's. Afterwards a new trainer resumes from that checkpoint.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import signal
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import hivemind
import pytest
import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from transformers import AutoModelForMaskedLM

from arguments import PeerArguments
from collab.checkpoint import list_checkpoints
from collab.dht import start_dht
from collab.schema import LocalMetrics, make_validators, metrics_key, read_metrics
from tests.conftest import RecordingServer, serve_recording
from tests.integration.agreement import (
    assert_parameters_agree,
    averaged_everything,
    initial_parameters,
    saved_parameters,
)
from trainer.local import LocalProcess, MonitorProcess, PeerProcess, free_port, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

# The timeline's faults (C joins, M crashes and restarts, C is killed, C2 joins) play out by about epoch 11.
MAX_STEPS = 13
# Two peers' "averaged" events less than this apart belong to the same round (they end within 0.1 s of each other).
SAME_ROUND_SECONDS = 3
# Epochs of 4-8 s, several matchmaking_times long as the trainer asks (docs/RELIABILITY.md has what shorter ones
# did). next_chunk_timeout stays at 3 s for groupmates that trigger late.
FAST = [
    "--target_batch_size",
    "256",
    "--matchmaking_time",
    "1",
    "--next_chunk_timeout",
    "3",
    "--averaging_timeout",
    "15",
    "--total_steps",
    str(MAX_STEPS),
]
C_EXPIRATION = 8  # seconds C's metrics stay alive after it is killed
FRESH_LOSS = math.log(4096)  # a fresh model's loss: uniform over data/sample's vocabulary of 4096 tokens
FORGED_STEP = 10**6
TOKEN = "upload-token"
B_NAME = "volunteer <B> & co"  # B's --public_name: shown as given, escaped where it is displayed
FAULTY = ["--faults", "nan_loss@3,nan_parameters@6"]  # tests/faulty_peer.py's flag: A's faults
MONITOR_CRASH = ["--faults", "pause_checkpoint_write@2=120"]  # tests/faulty_monitor.py's flag


@dataclass
class Collaboration:
    prefix: str
    monitors: list[LocalProcess]
    peers: dict[str, LocalProcess]
    exit_codes: dict[str, int | None]
    output: Path
    upload_server: RecordingServer
    killed_c_at: float | None = None
    checkpoints_when_monitor_died: list[int] | None = None
    invalid_when_monitor_died: list[str] = field(default_factory=list)
    partial_save_left: bool = False
    monitor_alive_at_end: bool = False
    monitor_exit_code: int | None = None
    metrics_seen: list[dict[bytes, LocalMetrics]] = field(default_factory=list)
    forged_store_accepted: bool | None = None
    malformed_store_accepted: bool | None = None
    liar_key: bytes | None = None
    settled_epoch: int | None = None

    def metrics_lines(self) -> list[dict]:
        return [json.loads(line) for line in (self.output / "metrics.jsonl").read_text().splitlines()]

    @property
    def monitor_log(self) -> str:
        return "".join(monitor.log() for monitor in self.monitors)


def try_forgeries(intruder: hivemind.DHT, prefix: str, victim: bytes) -> tuple[bool, bool]:
    """An outsider without the victim's key overwrites its record, and stores a malformed one of its own."""
    forged = LocalMetrics(step=FORGED_STEP, samples_per_second=1.0, samples_accumulated=1, loss=0.0, mini_steps=1)
    expiration = get_dht_time() + 60
    forged_ok = intruder.store(metrics_key(prefix), forged.model_dump(), expiration, subkey=victim)
    malformed_ok = intruder.store(metrics_key(prefix), {"step": "lots", "loss": -1}, expiration, subkey=b"intruder")
    return bool(forged_ok), bool(malformed_ok)


def publish_nan_loss(liar: hivemind.DHT, prefix: str, public_key: bytes) -> None:
    """A peer that signs correctly but lies: its own record, with a NaN loss and a step far ahead."""
    record = {
        "step": FORGED_STEP + 1,
        "samples_per_second": 1.0,
        "samples_accumulated": 1,
        "loss": math.nan,
        "mini_steps": 1,
    }
    liar.store(metrics_key(prefix), record, get_dht_time() + 60, subkey=public_key)


def current_step(records) -> int:
    return max((LocalMetrics.model_validate(value).step for value, _ in records.values()), default=-1)


def averaging_starts(peer: LocalProcess) -> int:
    return len(peer.events("step_begun"))


@pytest.fixture(scope="module")
def collaboration(tmp_path_factory, sample_data):
    out = tmp_path_factory.mktemp("collab")
    prefix = f"itest{int(time.time())}"
    repo = out / "checkpoints"
    with serve_recording() as upload_server:
        upload_server.statuses = [503]  # the first upload is refused: the monitor must retry
        monitor_argv = [
            "--experiment_prefix",
            prefix,
            *FAST,
            "--host_maddrs",
            f"/ip4/127.0.0.1/tcp/{free_port()}",
            "--identity_path",
            str(out / "monitor.key"),
            "--refresh_period",
            "1",
            "--metrics_path",
            str(out / "metrics.jsonl"),
            "--store_checkpoints",
            "--repo_path",
            str(repo),
            "--save_checkpoint_step_interval",
            "2",
            "--keep_checkpoints",
            "3",
            "--upload_interval",
            "4",
            "--upload_to",
            upload_server.url + "/upload",
            "--web_token",
            TOKEN,
        ]
        monitors = [MonitorProcess([*MONITOR_CRASH, *monitor_argv], out / "M.log", script="tests/faulty_monitor.py")]
        peers: dict[str, LocalProcess] = {}
        reader = intruder = liar = None
        try:
            join = monitors[0].join_flags(timeout=120)
            common = ["--experiment_prefix", prefix, *FAST, *join, "--statistics_expiration", "120"]
            peers["A"] = PeerProcess(
                [*FAULTY, *common, "--backup_every_steps", "2", "--output_dir", str(out / "A")],
                out / "A.log",
                script="tests/faulty_peer.py",
            )
            peers["B"] = PeerProcess(
                [*common, "--max_steps", str(MAX_STEPS), "--public_name", B_NAME, "--output_dir", str(out / "B")],
                out / "B.log",
            )
            # C and C2 know two addresses, as a volunteer would: the monitor's (down while it restarts) and A's
            c_argv = [
                *common,
                "--initial_peers",
                *join[1:],
                *peers["A"].join_flags(120)[1:],
                "--statistics_expiration",
                str(C_EXPIRATION),
            ]
            validators, _ = make_validators(prefix)
            reader = start_dht(
                PeerArguments(experiment_prefix=prefix, initial_peers=join[1:]), validators, client_mode=True
            )
            intruder = hivemind.DHT(initial_peers=join[1:], client_mode=True, start=True)
            liar_validator = RSASignatureValidator()  # signs its own records, skips the schema
            liar = hivemind.DHT(
                initial_peers=join[1:], client_mode=True, start=True, record_validators=[liar_validator]
            )
            result = Collaboration(prefix, monitors, peers, {}, out, upload_server)
            result.liar_key = liar_validator.local_public_key
            last_starts = {"C": 0}

            def crash_monitor_mid_save() -> None:
                monitors[0].crash()
                valid, invalid = list_checkpoints(repo)
                result.checkpoints_when_monitor_died = [manifest.step for _, manifest in valid]
                result.invalid_when_monitor_died = [str(folder) for folder, _ in invalid]
                result.partial_save_left = any(p.name.startswith(".tmp-") for p in repo.iterdir())
                # as an operator would: the restarted first node finds the others through a live peer's address
                monitors.append(MonitorProcess([*monitor_argv, *peers["B"].join_flags(60)], out / "M2.log"))

            def settled_checkpoint_saved() -> bool:
                result.settled_epoch = result.settled_epoch or settled_epoch(peers["A"], peers["C2"])
                steps = [manifest.step for _, manifest in list_checkpoints(repo)[0]]
                return result.settled_epoch is not None and any(step >= result.settled_epoch for step in steps)

            def poll() -> bool:
                records = read_metrics(reader, prefix)
                result.metrics_seen.append({k: LocalMetrics.model_validate(v) for k, (v, _) in records.items()})
                if records and result.forged_store_accepted is None:
                    victim = next(iter(records))
                    result.forged_store_accepted, result.malformed_store_accepted = try_forgeries(
                        intruder, prefix, victim
                    )
                    publish_nan_loss(liar, prefix, result.liar_key)
                if current_step(records) >= 2 and "C" not in peers:
                    peers["C"] = PeerProcess([*c_argv, "--output_dir", str(out / "C")], out / "C.log")
                if len(monitors) == 1 and monitors[0].events("fault_injected"):
                    crash_monitor_mid_save()
                ready_to_kill_c = (
                    "C" in peers
                    and "C2" not in peers
                    and len(monitors) == 2
                    and monitors[1].events("step_reported")
                    and len(peers["C"].averaging_group_sizes()) >= 2
                )
                if ready_to_kill_c:
                    starts = averaging_starts(peers["C"])
                    if starts > last_starts["C"] > 0:  # a round began since the last poll: C is mid-averaging
                        peers["C"].crash()
                        result.killed_c_at = time.time()
                        peers["C2"] = PeerProcess([*c_argv, "--output_dir", str(out / "C2")], out / "C2.log")
                    last_starts["C"] = starts
                return (
                    peers["B"].process.poll() is not None  # B stopped by itself at its max_steps
                    and "C2" in peers
                    and peers["C2"].averaging_group_sizes()  # the restarted peer contributed again
                    and settled_checkpoint_saved()
                    and bool(lines_after_c_expired(result))  # the monitor reported after C's record expired
                )

            # Events, not time, end the run: process start-up is slow on a loaded machine, so A and C2 (no
            # max_steps) train until B has stopped, C2 has contributed and a checkpoint from a settled epoch exists.
            wait_until(poll, timeout=480, what="B to stop, C2 to contribute and a late checkpoint", poll=0.5)
            for name in ("A", "C2"):
                peers[name].process.send_signal(signal.SIGTERM)
            result.exit_codes = {name: peer.wait(timeout=60) for name, peer in peers.items()}
            result.monitor_alive_at_end = monitors[-1].process.poll() is None
            wait_until(lambda: upload_server.accepted, timeout=30, what="the monitor's first accepted upload")
            monitors[-1].process.send_signal(signal.SIGTERM)
            result.monitor_exit_code = monitors[-1].wait(timeout=30)
            yield result
        finally:
            for process in [*peers.values(), *monitors]:
                process.stop()
            for dht in (reader, intruder, liar):
                if dht is not None:
                    dht.shutdown()


def lines_after_c_expired(collaboration: Collaboration) -> list[dict]:
    """The monitor's metrics lines written once the killed C's record had expired."""
    if collaboration.killed_c_at is None or not (collaboration.output / "metrics.jsonl").exists():
        return []
    expired_at = collaboration.killed_c_at + C_EXPIRATION + 2
    return [line for line in collaboration.metrics_lines() if line["time"] > expired_at]


def settled_epoch(a: LocalProcess, c2: LocalProcess) -> int | None:
    """The first epoch whose state holds a parameter round that A and C2 both completed in full at learning rate 0,
    or None before there is one: from then on nothing moves their parameters apart, so a checkpoint of this epoch or
    later matches A's final model. A round that ended while a peer was in epoch k + 1 (its last step began from k) is
    applied by the step into k + 2; one epoch more allows for a state served while that step is being applied."""
    c2_rounds = [record["time"] for record in complete_parameter_rounds(c2)]
    steps_begun = [peer.events("step_begun") for peer in (a, c2)]
    for record in complete_parameter_rounds(a):
        same_round_in_c2 = any(abs(time_ - record["time"]) < SAME_ROUND_SECONDS for time_ in c2_rounds)
        stepped_from = [last_step_begun_before(steps, record["time"]) for steps in steps_begun]
        if same_round_in_c2 and min(stepped_from) >= MAX_STEPS:  # learning rate 0 from MAX_STEPS
            return max(stepped_from) + 3
    return None


def complete_parameter_rounds(peer: LocalProcess) -> list[dict]:
    """``peer``'s parameter rounds in a group of two that averaged every value."""
    return [
        record
        for record in peer.events("averaged")
        if record["kind"] == "parameters" and record["group_size"] == 2 and averaged_everything(record, 2)
    ]


def last_step_begun_before(steps_begun: list[dict], moment: float) -> int:
    """The epoch from which the last of a peer's ``step_begun`` events before ``moment`` (a time.time()) began; -1
    before any."""
    return max((record["epoch"] for record in steps_begun if record["time"] <= moment), default=-1)


def final_epoch(peer: LocalProcess) -> int:
    shutdown = peer.events("shutdown")
    assert shutdown and shutdown[-1]["saved"], "peer did not save its model at its final epoch"
    return shutdown[-1]["epoch"]


def start_epoch(peer: LocalProcess) -> int | None:
    started = peer.events("started")
    return started[0]["epoch"] if started else None


def test_peers_reach_their_max_steps_and_exit_cleanly(collaboration):
    assert collaboration.exit_codes == {"A": 0, "B": 0, "C": -signal.SIGKILL, "C2": 0}
    assert final_epoch(collaboration.peers["A"]) >= MAX_STEPS
    # B stops at the first epoch it holds at or past its max_steps: MAX_STEPS, or later where a state download
    # caught it up past it (out of sync one epoch before MAX_STEPS, it loaded the swarm's state of one after)
    b_epochs = [record["epoch"] for record in collaboration.peers["B"].events("epoch")]
    assert b_epochs[-1] == final_epoch(collaboration.peers["B"]) >= MAX_STEPS
    assert max(b_epochs[:-1]) < MAX_STEPS


def test_events_tell_what_each_peer_did(collaboration):
    """The events files (docs/EVENTS.md) of a trainer and of the monitor, as an operator's tool reads them."""
    a = collaboration.peers["A"]
    names = [record["event"] for record in a.events()]
    assert names[0] == "joined" and a.events("joined")[0]["address"][0].startswith("/ip4/127.0.0.1/tcp/")
    assert names[-1] == "shutdown" and a.events("shutdown")[-1]["saved"] is True
    epochs = [record["epoch"] for record in a.events("epoch")]
    assert epochs == sorted(set(epochs)) and epochs[-1] >= MAX_STEPS
    rounds = a.events("averaged")
    assert {record["kind"] for record in rounds} == {"gradients", "parameters"}
    # a round whose groupmate left mid-way (SIGTERM at the end) may have received nothing; it says so
    complete = [r for r in rounds if r["group_size"] > 1 and r["values_kept_local"] == r["senders_dropped"] == 0]
    assert complete and all(r["bytes_sent"] > 0 and r["bytes_received"] > 0 and r["seconds"] >= 0 for r in complete)
    cut_short = [r for r in rounds if r["group_size"] > 1 and r not in complete]
    assert all(r["bytes_received"] > 0 or r["values_kept_local"] + r["senders_dropped"] > 0 for r in cut_short)
    assert [r["rollbacks"] for r in a.events("rollback")] == [1]
    loaded = collaboration.peers["C"].events("state_loaded")
    assert loaded and loaded[0]["epoch"] >= 2 and loaded[0]["bytes"] > 0
    assert collaboration.peers["C"].events()[-1]["event"] != "shutdown", "a peer killed by SIGKILL said goodbye"
    reported = [record["step"] for monitor in collaboration.monitors for record in monitor.events("step_reported")]
    assert reported == [line["step"] for line in collaboration.metrics_lines()]
    saved = [record["step"] for monitor in collaboration.monitors for record in monitor.events("checkpoint_saved")]
    assert saved and saved == sorted(saved)


def test_peers_average_gradients_with_each_other(collaboration):
    for name in "AB":
        rounds = collaboration.peers[name].averaging_group_sizes()
        assert len(rounds) >= MAX_STEPS - 6, f"peer {name} averaged only {len(rounds)} times"
        assert max(rounds) >= 2


def test_parameters_agree_within_fp16_tolerance(collaboration):
    # A and C2 stop together after averaging together; B stops earlier (its max_steps), and with delayed optimizer
    # steps a departing peer may or may not hold the last update, about one Lamb step (~1%) apart: B is checked
    # for finiteness only.
    a, b, c2 = (saved_parameters(collaboration.output / name) for name in ("A", "B", "C2"))
    assert a.keys() == b.keys() == c2.keys()
    for name in a:
        assert all(torch.isfinite(p[name]).all() for p in (a, b, c2)), f"{name} is not finite"
    assert_parameters_agree(a, c2, "A and C2")
    initial = initial_parameters()
    moved = max((a[name] - initial[name]).abs().max().item() for name in a)
    assert moved > 0.01, "parameters barely moved: the peers did not train"


def test_faulty_peer_drops_the_bad_batch_and_rolls_back(collaboration):
    peer = collaboration.peers["A"]
    injected = {fault["fault"] for fault in peer.events("fault_injected")}
    assert "nan_loss" in injected and peer.events("batch_dropped")
    assert "nan_parameters" in injected and [r["rollbacks"] for r in peer.events("rollback")] == [1]
    assert not peer.tracebacks_from_our_code()


def test_late_peer_loads_state_from_peers_and_contributes(collaboration):
    start = start_epoch(collaboration.peers["C"])
    assert start is not None and start >= 2, "the late peer did not download the collaboration's state"
    assert len(collaboration.peers["C"].averaging_group_sizes()) >= 2


def test_killed_peer_restarts_loads_the_state_and_contributes_again(collaboration):
    start = start_epoch(collaboration.peers["C2"])
    assert start is not None and start >= 4
    assert collaboration.peers["C2"].averaging_group_sizes(), "the restarted peer never averaged"


def test_others_keep_stepping_after_a_peer_dies_mid_averaging(collaboration):
    lines = collaboration.metrics_lines()
    before = max(line["step"] for line in lines if line["time"] <= collaboration.killed_c_at)
    soon_after = [
        line["step"] for line in lines if collaboration.killed_c_at < line["time"] <= collaboration.killed_c_at + 60
    ]
    assert soon_after and max(soon_after) >= before + 2, "the collaboration stalled after a peer died mid-round"


def test_outside_client_sees_every_peer(collaboration):
    peers_seen = set().union(*(seen.keys() for seen in collaboration.metrics_seen))
    assert len(peers_seen) >= 3
    assert all(b"[owner:" in key for key in peers_seen)


def test_forged_malformed_and_non_finite_records_are_rejected(collaboration):
    assert collaboration.forged_store_accepted is False
    assert collaboration.malformed_store_accepted is False
    for seen in collaboration.metrics_seen:
        assert b"intruder" not in seen and collaboration.liar_key not in seen
        assert all(metrics.step < FORGED_STEP for metrics in seen.values())
    assert all(line["step"] < FORGED_STEP and line["loss"] is not None for line in collaboration.metrics_lines()[1:])


def test_monitor_writes_one_line_per_step_with_alive_peers_and_falling_loss(collaboration):
    lines = collaboration.metrics_lines()
    base = {"step", "loss", "alive_peers", "samples", "samples_per_second", "time", "contributors"}
    assert all(set(line) in (base, base | {"eval_loss", "eval_perplexity"}) for line in lines)
    evaluated = [line for line in lines if "eval_loss" in line]
    assert len(evaluated) >= 2 and evaluated[-1]["eval_loss"] < evaluated[0]["eval_loss"], "checkpoints got no better"
    steps = [line["step"] for line in lines]
    assert steps == sorted(set(steps)) and steps[-1] >= MAX_STEPS, "steps repeat or go back (across the restart)"
    assert max(line["alive_peers"] for line in lines) >= 3
    losses = [line["loss"] for line in lines if line["loss"] is not None]
    assert losses[-1] < losses[0] - 0.3
    console = [line for line in collaboration.monitor_log.splitlines() if re.search(r"step \d+  loss ", line)]
    assert len(console) == len(lines)


def test_the_metrics_line_lists_each_contributor_and_the_name_it_chose(collaboration):
    contributors = collaboration.metrics_lines()[-1]["contributors"]
    named = [c for c in contributors if c["name"] is not None]
    assert [c["name"] for c in named] == [B_NAME], "B's --public_name is missing, or a peer got a name it never chose"
    # B, A, C and C2 published: the restarted monitor saw at least A, B and C2 (C's record may have come and gone)
    assert 3 <= len(contributors) <= 4 and len({c["peer"] for c in contributors}) == len(contributors)
    assert all(re.fullmatch(r"[0-9a-f]{12}", c["peer"]) for c in contributors)
    (b,) = named
    assert b["rounds"] >= 5 and b["samples"] >= b["rounds"] and b["seconds_online"] > 0
    assert [c["samples"] for c in contributors] == sorted((c["samples"] for c in contributors), reverse=True)


def test_monitor_survives_a_killed_peer_and_stops_counting_it(collaboration):
    assert collaboration.killed_c_at is not None
    assert collaboration.monitor_alive_at_end and collaboration.monitor_exit_code == 0
    after = [line["alive_peers"] for line in lines_after_c_expired(collaboration)]
    # Alive by then: A, C2 (C restarted) and B until it stops and falls behind; C itself counted too would make 4.
    assert after and max(after) <= 3, f"the killed peer was still counted after its record expired: {after}"
    assert not collaboration.monitors[-1].tracebacks_from_our_code()


def test_monitor_killed_mid_save_loses_no_checkpoint_and_resumes(collaboration):
    assert collaboration.checkpoints_when_monitor_died, "the first checkpoint was not on disk when the monitor died"
    assert not collaboration.invalid_when_monitor_died and collaboration.partial_save_left
    (found,) = collaboration.monitors[1].events("checkpoints_found")
    assert found["partial_saves_removed"] >= 1 and found["step"] >= max(collaboration.checkpoints_when_monitor_died)
    valid, invalid = list_checkpoints(collaboration.output / "checkpoints")
    assert not invalid and not [p for p in (collaboration.output / "checkpoints").iterdir() if p.name.startswith(".")]
    assert valid[-1][1].step > max(collaboration.checkpoints_when_monitor_died), "saving did not resume"


def test_checkpoint_matches_the_peers_parameters_and_loads(collaboration):
    valid, invalid = list_checkpoints(collaboration.output / "checkpoints")
    assert not invalid and 1 <= len(valid) <= 3
    folder, manifest = valid[-1]
    assert manifest.step >= collaboration.settled_epoch > MAX_STEPS and manifest.peers >= 1
    model = AutoModelForMaskedLM.from_pretrained(folder)
    final_a = saved_parameters(collaboration.output / "A")
    checkpoint = {name: tensor for name, tensor in model.state_dict().items() if name in final_a}
    assert checkpoint, "the checkpoint and A's saved model share no tensor names"
    assert_parameters_agree({name: final_a[name] for name in checkpoint}, checkpoint, "A and the checkpoint")


def test_checkpoint_uploaded_after_a_refusal(collaboration):
    server = collaboration.upload_server
    assert len(server.refused) >= 1 and server.accepted
    request = server.accepted[-1]
    assert request.path == "/upload" and request.headers["Authorization"] == f"Bearer {TOKEN}"
    form = request.form()
    assert hashlib.sha256(form["archive"]).hexdigest() == form["sha256"].decode()
    with tarfile.open(fileobj=io.BytesIO(form["archive"])) as tar:
        names = tar.getnames()
    assert f"{int(form['step'])}/manifest.json" in names and f"{int(form['step'])}/model.safetensors" in names


def test_trainer_resumes_from_a_checkpoint_when_no_peer_is_online(collaboration, tmp_path):
    folder, manifest = list_checkpoints(collaboration.output / "checkpoints")[0][-1]
    peer = PeerProcess(
        [
            "--experiment_prefix",
            f"resume{int(time.time())}",
            "--resume_from",
            str(folder),
            "--target_batch_size",
            "32",
            "--total_steps",
            "1000",
            "--max_steps",
            str(manifest.step + 1),
            "--output_dir",
            str(tmp_path / "out"),
        ],
        tmp_path / "resume.log",
    )
    try:
        assert peer.wait(timeout=180) == 0
    finally:
        peer.stop()
    assert [(r["path"], r["epoch"]) for r in peer.events("resumed")] == [(str(folder), manifest.step)]
    assert start_epoch(peer) == manifest.step
    first_loss = next(r["loss"] for r in peer.events("epoch") if r["epoch"] == manifest.step + 1)
    reported = {line["step"]: line["loss"] for line in collaboration.metrics_lines() if line.get("loss") is not None}
    swarm_loss = reported[max(step for step in reported if step <= manifest.step)]
    # the swarm's loss moves a few hundredths an epoch by then; a fresh model's is a third of the way back or more
    assert first_loss < swarm_loss + (FRESH_LOSS - swarm_loss) / 3, (
        f"a resumed peer should start near the swarm's loss at the checkpoint ({swarm_loss:.3f}), "
        f"not at a fresh model's (~{FRESH_LOSS:.2f}): {first_loss:.3f}"
    )


def test_sigterm_and_sigint_shut_down_cleanly_and_save_the_model(tmp_path, sample_data):
    signals = {"term": signal.SIGTERM, "int": signal.SIGINT}
    peers = {
        name: PeerProcess(
            [
                "--experiment_prefix",
                f"sig{name}{int(time.time())}",
                "--target_batch_size",
                "100000",
                "--output_dir",
                str(tmp_path / name),
            ],
            tmp_path / f"{name}.log",
        )
        for name in signals
    }
    try:
        for peer in peers.values():
            wait_until(
                lambda p=peer: p.events("started") or p.process.poll() is not None,
                120,
                "the peer to start training",
            )
        signalled = {}
        for name, peer in peers.items():
            os.killpg(peer.process.pid, signals[name])  # as Ctrl-C in a terminal does: to the peer's process group
            signalled[name] = time.monotonic()
        codes = {
            name: peer.wait(timeout=max(0.1, signalled[name] + 30 - time.monotonic())) for name, peer in peers.items()
        }
        assert codes == {"term": 0, "int": 0}, "a peer did not exit 0 within 30 s of its signal"
    finally:
        for peer in peers.values():
            peer.stop()
    for name, peer in peers.items():
        assert (tmp_path / name / "model.safetensors").exists()
        assert [stop["signal"] for stop in peer.events("stop_requested")] == [signals[name].name]
        assert not peer.tracebacks_from_our_code()


def test_unreachable_initial_peer_fails_fast_with_a_clear_message(tmp_path, sample_data):
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWGSiXnbyZEN46UhS1odotVQFtBHtxH5gfoJHwGhNiwYDd"
    peer = PeerProcess(["--initial_peers", dead, "--bootstrap_timeout", "2"], tmp_path / "peer.log")
    try:
        assert peer.wait(timeout=120) == 2
    finally:
        peer.stop()
    last_line = peer.log().strip().splitlines()[-1]
    assert last_line.startswith("run_trainer.py: error: --initial_peers:") and "answered" in last_line
