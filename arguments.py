"""Every setting of the trainer and the monitor, one dataclass per concern.

These dataclasses are the single source of truth: their fields are the command-line flags, the keys of a JSON
config, and (through the same parsing path) the fields of the web form. Each help string states its unit.
Validation lives in ``__post_init__`` and names the flag to fix, so a bad value fails the same way everywhere.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_type_hints

from transformers import HfArgumentParser

from collab.errors import ConfigError
from collab.names import MAX_PUBLIC_NAME_CHARS, public_name_problem
from collab.wire import bearer_header

# The kinds of training --task chooses, named once: trainer/tasks.py maps each to its model head, data and metrics.
MASKED_LM, CAUSAL_LM, SEQUENCE_CLASSIFICATION, QUESTION_ANSWERING = "mlm", "clm", "seq-cls", "qa"
TaskName = Literal[MASKED_LM, CAUSAL_LM, SEQUENCE_CLASSIFICATION, QUESTION_ANSWERING]


def _fail(flag: str, problem: str) -> None:
    raise ConfigError(f"--{flag}: {problem}", field=flag)


def _require_positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            _fail(name, f"must be a positive number (got {value!r})")


def _require_non_negative(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            _fail(name, f"must be zero or a positive number (got {value!r})")


LOOPBACK_ANY_PORT = "/ip4/127.0.0.1/tcp/0"  # the default listen address


def _check_multiaddrs(flag: str, maddrs: Sequence[str], need_peer_id: bool = False) -> None:
    unchecked = [maddr for maddr in maddrs if maddr != LOOPBACK_ANY_PORT]
    if not unchecked:
        return  # hivemind's parser loads all of hivemind and torch: not for the default, so other flags fail fast
    from hivemind.utils.multiaddr import Multiaddr

    for maddr in unchecked:
        try:
            protocols = [protocol.name for protocol in Multiaddr(maddr).protocols()]
        except Exception as e:
            _fail(flag, f"{maddr!r} is not a multiaddr ({e}); expected e.g. /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...")
        if need_peer_id and "p2p" not in protocols:
            _fail(flag, f"{maddr!r} has no /p2p/<peer id> part: copy the whole address the first peer logged")


@dataclass
class PeerArguments:
    """How this process joins the DHT: the only rendezvous of the collaboration."""

    experiment_prefix: str = field(
        default="collab_demo",
        metadata={"help": "Name of the experiment; every DHT key of the collaboration starts with it"},
    )
    initial_peers: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Multiaddrs of running peers to join (/ip4/HOST/tcp/PORT/p2p/PEER_ID), as the first peer or "
            "the monitor logs them; empty: start a new collaboration"
        },
    )
    host_maddrs: list[str] = field(
        default_factory=lambda: [LOOPBACK_ANY_PORT],
        metadata={
            "help": "Multiaddrs to listen on; the default listens on loopback only. Use /ip4/0.0.0.0/tcp/31337 to "
            "accept peers from other machines (port 0: any free port)"
        },
    )
    announce_maddrs: list[str] = field(
        default_factory=list,
        metadata={"help": "Public multiaddrs to announce to other peers, e.g. behind NAT or a port forward"},
    )
    identity_path: str | None = field(
        default=None,
        metadata={"help": "File with this peer's private key, created if missing: keeps the peer ID stable"},
    )
    use_ipfs: bool = field(
        default=False,
        metadata={"help": "Bootstrap through the public IPFS DHT (then /p2p/PEER_ID alone finds a peer)"},
    )
    client_mode: bool = field(
        default=False,
        metadata={
            "help": "Accept no incoming connections (firewalled or NAT'd peers); at least one peer of the "
            "collaboration must not be a client"
        },
    )
    use_relay: bool = field(
        default=True,
        metadata={
            "help": "Accept and dial connections through libp2p circuit relays, and relay for others (hivemind's "
            "default); false: direct connections only"
        },
    )
    use_auto_relay: bool = field(
        default=False,
        metadata={
            "help": "For a peer behind NAT or a firewall: reserve a slot on a relay (the --initial_peers) and "
            "announce the relayed address, so others reach this peer through it; needs --use_relay"
        },
    )
    bootstrap_timeout: float = field(
        default=15.0,
        metadata={"help": "Seconds to wait for the initial peers to answer before giving up with an error"},
    )
    authorization_url: str | None = field(
        default=None,
        metadata={
            "help": "Web app join endpoint (http://HOST:8000/api/experiments/ID/join): when set, this peer gets an "
            "access token there and accepts only DHT requests from peers holding one; unset: no access control"
        },
    )
    web_token: str | None = field(
        default=None,
        metadata={
            "help": "The web app's token for this experiment: the peer token for trainers (--authorization_url), "
            "the monitor token for the monitor (also --report_url and http(s) uploads); unset: --config_token"
        },
    )
    events_path: str | None = field(
        default=None,
        metadata={
            "help": "File this process appends its events to, one JSON object per line (joined, epoch, averaged, "
            "...; docs/EVENTS.md), for scripts and tools; unset: no events file"
        },
    )

    def __post_init__(self) -> None:
        if not self.experiment_prefix or not all(c.isalnum() or c in "_-." for c in self.experiment_prefix):
            _fail("experiment_prefix", f"use letters, digits, '_', '-' or '.' (got {self.experiment_prefix!r})")
        _check_multiaddrs("initial_peers", self.initial_peers, need_peer_id=not self.use_ipfs)
        _check_multiaddrs("host_maddrs", self.host_maddrs)
        _check_multiaddrs("announce_maddrs", self.announce_maddrs)
        if not self.host_maddrs:
            _fail("host_maddrs", "give at least one address to listen on, e.g. /ip4/127.0.0.1/tcp/0")
        _require_positive(self, "bootstrap_timeout")
        if self.use_auto_relay and not self.use_relay:
            _fail("use_auto_relay", "needs --use_relay (a relayed peer is reached through a circuit relay)")
        if self.use_auto_relay and self.client_mode:
            _fail("use_auto_relay", "a --client_mode peer accepts no connections, relayed or not: drop one of them")
        if self.use_auto_relay and not (self.initial_peers or self.use_ipfs):
            _fail("use_auto_relay", "give --initial_peers: they are the relays this peer reserves a slot on")
        if self.authorization_url is not None and not self.authorization_url.startswith(("http://", "https://")):
            _fail("authorization_url", f"must be an http(s):// URL (got {self.authorization_url!r})")


MAX_LOCAL_STEPS = 100_000  # DiLoCo's largest tested interval is 500 inner steps; beyond this no round would happen
MAX_NONFINITE_BATCH_LIMIT = 100_000  # mini-batches: a limit past this never stops a diverged peer in a day
MAX_OUTER_LEARNING_RATE = 10.0  # DiLoCo uses 0.7; far above 1 the outer step overshoots the pseudo-gradient
MAX_SHUTDOWN_TIMEOUT = 3600.0  # seconds; also caps the derived deadline (collab.timeouts)
# topk's share of each tensor sent per round: the smallest whose loss kept within 2 % of the synchronous mode's
# (docs/benchmarks/2026-11-28-amd-epyc-2core-repairs.md)
DEFAULT_TOPK_FRACTION = 0.03


@dataclass
class OptimizerArguments:
    """The collaboration's global step: when it happens and how gradients and state travel."""

    # 1024: an epoch of the default model on two CPU peers then lasts long enough to hide matchmaking and averaging;
    # at 256 epochs stretch to matchmaking_time and beyond (docs/benchmarks/2026-11-25-amd-epyc-2core.md).
    target_batch_size: int = field(
        default=1024,
        metadata={
            "help": "Samples the whole collaboration accumulates per optimizer step (one global epoch); size it so "
            "that an epoch lasts several times matchmaking_time, or averaging rounds overlap (peers warn when not)"
        },
    )
    batch_size_lead: int = field(
        default=0,
        metadata={"help": "Start averaging this many samples before target_batch_size is reached (samples)"},
    )
    matchmaking_time: float = field(
        default=3.0,
        metadata={
            "help": "Seconds to wait for peers to form an averaging group (3-5 on a LAN, 10-15 online); longer while "
            "this peer's DHT takes long to store and look up the group's records (1.5x their time, logged)"
        },
    )
    averaging_timeout: float | None = field(
        default=None,
        metadata={
            "help": "Seconds after which an averaging round is abandoned (about 2x the all-reduce time). Default: "
            "derived from the model's size, --bandwidth and --target_group_size, at least 60 (collab/timeouts.py)"
        },
    )
    next_chunk_timeout: float | None = field(
        default=None,
        metadata={
            "help": "Seconds an averaging round waits for a groupmate's next piece of data before it averages without "
            "that peer. Default: derived from --bandwidth, at least matchmaking_time (hivemind's default). A floor: "
            "after rounds where groupmates started their part later, or one was dropped, each averager waits longer "
            "(twice the latest start of its last rounds, within the round's time; collab/timeouts.py). Shorter loses "
            "less time when a matched peer never comes (each such round waits this long)"
        },
    )
    grad_compression: Literal["fp16", "8bit"] = field(
        default="fp16",
        metadata={
            "help": "How gradients travel in averaging: fp16 (2 bytes a value), or 8bit (tensors of 65,536 values or "
            "more as 8-bit uniform quantization, 1 byte a value, smaller ones fp16; sahajBERT's choice) for slow links"
        },
    )
    load_state_timeout: float | None = field(
        default=None,
        metadata={
            "help": "Seconds one try to download the state from a peer may take (up to 8 peers are tried, with "
            "backoff). Default: derived from the state's size and --bandwidth, at least 120"
        },
    )
    shutdown_timeout: float | None = field(
        default=None,
        metadata={
            "help": "Seconds from the first SIGTERM or Ctrl-C to a forced exit, which reports an unsaved model in its "
            "exit code. Default: derived from the model's size and --bandwidth, at least 25. Give less than your "
            "supervisor waits before SIGKILL (docker stop: 10 s, Kubernetes: 30 s); at most 3600"
        },
    )
    bandwidth: float = field(
        default=100.0,
        metadata={
            "help": "This peer's upload bandwidth in Mbit/s (the slower direction of most links): balances all-reduce "
            "load and sizes the derived timeouts, assuming groupmates and donors have at least as much"
        },
    )
    offload_optimizer: bool = field(
        default=True,
        metadata={"help": "Keep the optimizer and its state in host memory, not on the GPU"},
    )
    delay_optimizer_step: bool = field(
        default=True,
        metadata={"help": "Run the optimizer step in the background and apply it one step later (needs offload)"},
    )
    delay_grad_averaging: bool = field(
        default=True,
        metadata={"help": "Average gradients in the background (needs delay_optimizer_step)"},
    )
    average_state_every: int | None = field(
        default=None,
        metadata={
            "help": "Average parameters with peers every this many global epochs (Lamb's statistics are not averaged: "
            "every peer updates them from the same averaged gradients). Unset: 2 in the synchronous mode; in the "
            "low-communication mode, as rarely as keeps a parameter round's bytes at an eighth of the "
            "pseudo-gradients' (every 16 rounds with fp16, 32 with 8bit and topk). 1 repairs a peer that missed "
            "a round soonest; higher saves traffic"
        },
    )

    local_steps: int = field(
        default=0,
        metadata={
            "help": "Low-communication mode (DiLoCo): each peer takes about this many inner Lamb steps of its own per "
            "global epoch, which then ends when the swarm has processed local_steps x target_batch_size samples, "
            "with an outer Nesterov step on the averaged pseudo-gradients (README, 'Which mode to choose'). 0: the "
            "synchronous mode (gradients averaged every global epoch)"
        },
    )
    outer_learning_rate: float = field(
        default=0.7,
        metadata={"help": "Low-communication mode: the outer SGD's learning rate on pseudo-gradients (DiLoCo's 0.7)"},
    )
    outer_momentum: float = field(
        default=0.9,
        metadata={"help": "Low-communication mode: the outer SGD's Nesterov momentum, in [0, 1) (DiLoCo's 0.9)"},
    )
    pseudo_grad_compression: Literal["fp16", "8bit", "topk"] = field(
        default="fp16",
        metadata={
            "help": "Low-communication mode: how pseudo-gradients travel: fp16, 8bit (every matrix as 8-bit integers "
            "with a scale per 256 values, small vectors fp16), or topk (the largest --topk_fraction of each tensor at "
            "2 bits, the rest held back for later rounds)"
        },
    )
    topk_fraction: float = field(
        default=DEFAULT_TOPK_FRACTION,
        metadata={"help": "With --pseudo_grad_compression topk: the fraction of each tensor's values sent per round"},
    )

    def __post_init__(self) -> None:
        _require_positive(self, "target_batch_size", "matchmaking_time", "bandwidth")
        for name in (
            "average_state_every",
            "averaging_timeout",
            "next_chunk_timeout",
            "load_state_timeout",
            "shutdown_timeout",
        ):
            if getattr(self, name) is not None:  # None: derived from the model and --bandwidth (collab/timeouts.py)
                _require_positive(self, name)
        if self.shutdown_timeout is not None and self.shutdown_timeout > MAX_SHUTDOWN_TIMEOUT:
            _fail("shutdown_timeout", f"must be at most {MAX_SHUTDOWN_TIMEOUT:g} s (got {self.shutdown_timeout:g})")
        if not (isinstance(self.local_steps, int) and 0 <= self.local_steps <= MAX_LOCAL_STEPS):
            _fail("local_steps", f"must be an integer from 0 to {MAX_LOCAL_STEPS} (got {self.local_steps!r})")
        _require_positive(self, "outer_learning_rate", "topk_fraction")
        if self.outer_learning_rate > MAX_OUTER_LEARNING_RATE:
            _fail("outer_learning_rate", f"must be at most {MAX_OUTER_LEARNING_RATE} (got {self.outer_learning_rate})")
        _require_non_negative(self, "outer_momentum")
        if self.outer_momentum >= 1:
            _fail("outer_momentum", f"must be below 1 (got {self.outer_momentum}); DiLoCo uses 0.9")
        if self.topk_fraction > 1:
            _fail("topk_fraction", f"must be at most 1 (got {self.topk_fraction}); 0.03 sends 3 % of the values")
        if self.local_steps and not self.offload_optimizer:
            _fail(
                "offload_optimizer",
                "the low-communication mode (--local_steps) keeps the anchor in host memory: turn it on",
            )
        _require_non_negative(self, "batch_size_lead")
        if self.next_chunk_timeout is not None and self.averaging_timeout is not None:
            if self.next_chunk_timeout >= self.averaging_timeout / 2:
                _fail(
                    "next_chunk_timeout",
                    f"must be under half of --averaging_timeout ({self.next_chunk_timeout} >= "
                    f"{self.averaging_timeout} / 2): a round waits up to twice this for results; lower it or leave "
                    "it unset",
                )
        if self.batch_size_lead >= self.target_batch_size:
            _fail(
                "batch_size_lead",
                f"must be smaller than --target_batch_size ({self.batch_size_lead} >= {self.target_batch_size})",
            )
        if self.delay_optimizer_step and not self.offload_optimizer:
            _fail("delay_optimizer_step", "needs --offload_optimizer; turn it on or pass --delay_optimizer_step false")
        if self.delay_grad_averaging and not self.delay_optimizer_step:
            _fail(
                "delay_grad_averaging", "needs --delay_optimizer_step; turn it on or pass --delay_grad_averaging false"
            )


@dataclass
class AveragerArguments:
    """All-reduce groups."""

    target_group_size: int = field(
        default=256, metadata={"help": "Largest number of peers in one all-reduce group (peers)"}
    )

    def __post_init__(self) -> None:
        _require_positive(self, "target_group_size")
        if self.target_group_size < 2:
            _fail("target_group_size", f"must be at least 2 peers (got {self.target_group_size})")


@dataclass
class ProgressTrackerArguments:
    """How often a peer reads the collaboration's progress from the DHT, and publishes its own."""

    min_refresh_period: float = field(default=0.5, metadata={"help": "Shortest wait between progress reads (s)"})
    max_refresh_period: float | None = field(
        default=None,
        metadata={
            "help": "Longest wait between progress reads (s); reads come sooner as the next epoch nears. Unset: 10 "
            "in the synchronous mode; in the low-communication mode 10 x --local_steps, at most half of "
            "--metadata_expiration"
        },
    )
    default_refresh_period: float = field(
        default=3.0, metadata={"help": "Wait between progress reads when nothing is known yet (s)"}
    )
    expected_drift_peers: float = field(
        default=3.0, metadata={"help": "Peers expected to join or leave per step; shortens the refresh (peers)"}
    )
    expected_drift_rate: float = field(
        default=0.2, metadata={"help": "Expected relative change of the swarm's throughput per step (fraction)"}
    )
    metadata_expiration: float = field(
        default=60.0, metadata={"help": "Lifetime of this peer's progress record in the DHT (s)"}
    )
    progress_report_period: float | None = field(
        default=None,
        metadata={
            "help": "Shortest wait between two publications of this peer's progress within a global epoch (s); "
            "readers extrapolate in between and a new epoch is published at once (hivemind publishes every step). "
            "Unset: 2 in the synchronous mode; in the low-communication mode 2 x --local_steps, at most half of "
            "--metadata_expiration (each publication is a signed DHT store to several peers)"
        },
    )

    def __post_init__(self) -> None:
        _require_positive(self, "min_refresh_period", "default_refresh_period")
        _require_positive(self, "metadata_expiration")
        for name in ("max_refresh_period", "progress_report_period"):
            if getattr(self, name) is not None:
                _require_positive(self, name)
        _require_non_negative(self, "expected_drift_peers", "expected_drift_rate")
        if self.max_refresh_period is not None and self.min_refresh_period > self.max_refresh_period:
            _fail("min_refresh_period", f"must not exceed --max_refresh_period ({self.max_refresh_period})")


@dataclass
class CollaborationArguments:
    """What a trainer shares with the others besides gradients."""

    statistics_expiration: float = field(
        default=600.0,
        metadata={
            "help": "Lifetime of this peer's published metrics in the DHT (s); the monitor counts a peer "
            "alive until its record expires or falls alive_step_lag global epochs behind the swarm's step"
        },
    )
    backup_every_steps: int = field(
        default=10,
        metadata={
            "help": "Keep an in-memory copy of the model and optimizer every this many global epochs; "
            "restored when parameters become NaN or infinite"
        },
    )

    resume_from: str | None = field(
        default=None,
        metadata={
            "help": "Checkpoint saved by the monitor (its folder <repo_path>/<step>, or a checkpoint-<step>.tar.gz "
            "downloaded from the web app) to start from when no peer is online to download the state from; ignored "
            "when peers have a newer state"
        },
    )
    public_name: str | None = field(
        default=None,
        metadata={
            "help": f"Name shown beside this peer's contribution (samples, rounds, time online) on the dashboard and "
            f"in the monitor's metrics: 1 to {MAX_PUBLIC_NAME_CHARS} printable characters; unset: a short hash of "
            "the peer's public key only. Anyone can read it"
        },
    )

    def __post_init__(self) -> None:
        _require_positive(self, "statistics_expiration", "backup_every_steps")
        if self.public_name is not None and (problem := public_name_problem(self.public_name)) is not None:
            _fail("public_name", problem)


@dataclass
class DatasetArguments:
    """What to train: the task, the model and the data."""

    task: TaskName = field(
        default=MASKED_LM,
        metadata={
            "help": "What the collaboration trains: mlm (masked LM, BERT-like), clm (causal LM, GPT-2-like), "
            "seq-cls (classification: BoolQ's question/passage/label or text/label) or qa (extractive QA: "
            "SQuAD's id/question/context/answers)"
        },
    )
    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Local folder or Hugging Face model name to start from; a head the task needs and the "
            "checkpoint lacks is initialised (a warning lists it); unset: a tiny BERT built from a config, "
            "no download"
        },
    )
    dataset_path: str = field(
        default="data/sample/tokenized",
        metadata={
            "help": "Training data: for mlm/clm a tokenized dataset saved by `make data`; for seq-cls/qa a "
            "`datasets` name, a folder saved with save_to_disk, or a .json/.jsonl/.csv file"
        },
    )
    validation_path: str | None = field(
        default=None,
        metadata={
            "help": "Evaluation data in the same format as dataset_path; unset: the 'validation' split of dataset_path"
        },
    )
    tokenizer_path: str = field(
        default="data/sample/tokenizer",
        metadata={"help": "Tokenizer folder, used when --model_name_or_path has none of its own"},
    )
    num_labels: int = field(
        default=2, metadata={"help": "Number of classes for --task seq-cls, labelled 0..num_labels-1 (classes)"}
    )
    max_seq_length: int = field(
        default=128,
        metadata={
            "help": "Longest input for seq-cls and qa (tokens, question included); longer texts are cut, longer "
            "QA contexts split into windows. 384 is usual for SQuAD on BERT-base"
        },
    )
    doc_stride: int = field(
        default=32,
        metadata={"help": "Overlap between consecutive windows of a long QA context (tokens); 128 with 384"},
    )

    def __post_init__(self) -> None:
        _require_positive(self, "num_labels", "max_seq_length", "doc_stride")
        if self.task == SEQUENCE_CLASSIFICATION and self.num_labels < 2:
            _fail("num_labels", f"a classifier needs at least 2 classes (got {self.num_labels})")
        if self.doc_stride >= self.max_seq_length // 2:
            half = self.max_seq_length // 2
            _fail("doc_stride", f"must be under half of --max_seq_length ({self.doc_stride} >= {half})")


@dataclass
class TrainingArguments:
    """The local training loop. Names follow transformers.TrainingArguments; only options the loop honours."""

    per_device_train_batch_size: int = field(default=16, metadata={"help": "Samples per forward pass per device"})
    gradient_accumulation_steps: int = field(
        default=1,
        metadata={
            "help": "Forward passes accumulated before reporting progress to the optimizer; keep one optimizer step "
            "shorter than matchmaking_time, or the peer misses averaging rounds (it warns when not)"
        },
    )
    learning_rate: float = field(
        default=0.2,
        metadata={
            "help": "Peak learning rate of Lamb (after warmup); the default suits the tiny model, use ~0.00176 "
            "for BERT/ALBERT-size models with target_batch_size 4096"
        },
    )
    adam_beta1: float = field(default=0.9, metadata={"help": "Lamb beta1 (first-moment decay, fraction)"})
    adam_beta2: float = field(default=0.999, metadata={"help": "Lamb beta2 (second-moment decay, fraction)"})
    adam_epsilon: float = field(default=1e-6, metadata={"help": "Lamb epsilon (added to the denominator)"})
    weight_decay: float = field(
        default=0.01, metadata={"help": "Weight decay (fraction per step); never applied to biases and LayerNorms"}
    )
    clamp_value: float = field(default=10000.0, metadata={"help": "Lamb's clamp on the weight norm (trust ratio)"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Clip each mini-batch's gradient to this L2 norm"})
    warmup_steps: int = field(
        default=2,
        metadata={
            "help": "Global batches of target_batch_size samples (synchronous epochs; an outer round of --local_steps "
            "H holds H of them) of linear learning-rate warmup from 0 to learning_rate"
        },
    )
    total_steps: int = field(
        default=1000,
        metadata={"help": "Global batch (as --warmup_steps counts them) at which the linear decay reaches 0"},
    )
    max_steps: int = field(
        default=0,
        metadata={"help": "Stop this peer (exit 0) once the global epoch reaches this; 0: run until stopped"},
    )
    seed: int = field(default=42, metadata={"help": "Seed for model initialisation; data order is also keyed by peer"})
    fp16: bool = field(
        default=True,
        metadata={
            "help": "Mixed precision (fp16 autocast, loss scaling) on CUDA; CPUs train in fp32. --bf16 takes its place"
        },
    )
    bf16: bool = field(
        default=False,
        metadata={
            "help": "Mixed precision in bfloat16 (autocast, no loss scaling: fp32's range) in place of --fp16: on "
            "GPUs of compute capability 8.0+ (A100, RTX 30xx and newer; refused on older ones) and on CPUs, where it "
            "is faster than fp32 on those with bfloat16 instructions (AVX-512 BF16, AMX)"
        },
    )
    ddp_timeout: float | None = field(
        default=None,
        metadata={
            "help": "torchrun peers (one peer on all of a machine's GPUs): seconds a rank waits for the others in one "
            "exchange before the peer exits. Unset: derived from the model and --bandwidth, to cover rank 0's "
            "longest step (every try of a state download, then a round and a shutdown)"
        },
    )
    shard_model: bool = field(
        default=False,
        metadata={
            "help": "torchrun peers: shard the model's parameters and gradients across the ranks "
            "(FSDP, ZeRO-3), so that each GPU holds 1/N of the model: for models larger than one GPU. Rank 0 keeps "
            "the whole model in host memory for averaging. Costs an all-gather of the parameters per forward and "
            "backward, and rank 0's optimizer step runs on its CPU. A plain peer (no torchrun) ignores it"
        },
    )
    nonfinite_batch_limit: int = field(
        default=64,
        metadata={
            "help": "Mini-batches in a row with a non-finite loss or gradients (each one is dropped) after which the "
            "peer restores its last backup; another such streak before the restored state has stepped as many in a "
            "row stops it (exit 2): training diverged. fp16's loss scale halves at each dropped batch, so far below "
            "30 a peer can stop while its scale still settles"
        },
    )
    dataloader_num_workers: int = field(default=0, metadata={"help": "Worker processes loading batches (processes)"})
    output_dir: str = field(
        default="outputs/peer",
        metadata={"help": "Folder where this peer saves its model and tokenizer (save_pretrained) when it stops"},
    )

    def __post_init__(self) -> None:
        _require_positive(self, "per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate")
        _require_positive(self, "adam_epsilon", "clamp_value", "max_grad_norm", "total_steps")
        if not 1 <= self.nonfinite_batch_limit <= MAX_NONFINITE_BATCH_LIMIT:
            _fail(
                "nonfinite_batch_limit",
                f"must be from 1 to {MAX_NONFINITE_BATCH_LIMIT} (got {self.nonfinite_batch_limit})",
            )
        _require_non_negative(self, "weight_decay", "warmup_steps", "max_steps", "dataloader_num_workers")
        if self.ddp_timeout is not None:
            _require_positive(self, "ddp_timeout")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                _fail(name, f"must be in [0, 1) (got {getattr(self, name)})")
        if self.warmup_steps > self.total_steps:
            _fail("warmup_steps", f"must not exceed --total_steps ({self.warmup_steps} > {self.total_steps})")


@dataclass
class MetricsArguments:
    """The monitor's view of the swarm: how often it reads the peers' metrics, and where it reports them."""

    refresh_period: float = field(
        default=10.0, metadata={"help": "Seconds between two reads of the peers' metrics from the DHT"}
    )
    metrics_path: str | None = field(
        default=None,
        metadata={"help": "JSON-lines file that gets one object per new global step (step, loss, alive_peers, ...)"},
    )
    wandb_project: str | None = field(
        default=None,
        metadata={"help": "Weights & Biases project to log the metrics to; unset: wandb is not used"},
    )
    wandb_run_name: str | None = field(
        default=None, metadata={"help": "Weights & Biases run name; unset: the experiment_prefix"}
    )
    alive_step_lag: int = field(
        default=2,
        metadata={
            "help": "A peer counts as alive, and its loss and samples/s in the aggregate, while its newest metrics "
            "record is at most this many global epochs behind the swarm's step (the newest step an honest majority "
            "reached; records more than this many ahead of it are ignored). A peer that died or fell behind stops "
            "counting after that many epochs instead of when its record expires (statistics_expiration); raise it "
            "when epochs last only a few seconds"
        },
    )
    report_url: str | None = field(
        default=None,
        metadata={
            "help": "Web app endpoint that receives every aggregated step "
            "(http://HOST:8000/api/experiments/ID/metrics); unset: not reported"
        },
    )

    def __post_init__(self) -> None:
        _require_positive(self, "refresh_period")
        _require_non_negative(self, "alive_step_lag")
        if self.report_url is not None and not self.report_url.startswith(("http://", "https://")):
            _fail("report_url", f"must be an http(s):// URL (got {self.report_url!r})")


@dataclass
class CheckpointArguments:
    """The monitor's checkpoints: the swarm's state saved every few global epochs, and uploaded from there."""

    store_checkpoints: bool = field(
        default=False,
        metadata={"help": "Download the collaboration's state from peers and save checkpoints under repo_path"},
    )
    save_checkpoint_step_interval: int = field(
        default=5, metadata={"help": "Save a checkpoint every this many global epochs (global epochs)"}
    )
    repo_path: str = field(
        default="checkpoints", metadata={"help": "Folder that holds one sub-folder per saved global epoch"}
    )
    keep_checkpoints: int = field(
        default=3, metadata={"help": "Number of most recent checkpoints kept on disk (checkpoints)"}
    )
    upload_interval: float | None = field(
        default=None,
        metadata={"help": "Seconds between uploads of the latest checkpoint to upload_to; unset: never upload"},
    )
    upload_to: str | None = field(
        default=None,
        metadata={
            "help": "Where uploads go: a local folder, an http(s):// URL of the web app's checkpoint endpoint, "
            "or hf://owner/repo on the Hugging Face Hub"
        },
    )

    def __post_init__(self) -> None:
        _require_positive(self, "save_checkpoint_step_interval", "keep_checkpoints")
        if self.upload_interval is not None:
            _require_positive(self, "upload_interval")
            if not self.upload_to:
                _fail("upload_interval", "needs --upload_to (a folder, an http(s):// URL or hf://owner/repo)")
            if not self.store_checkpoints:
                _fail("upload_interval", "needs --store_checkpoints: only saved checkpoints are uploaded")
        if self.upload_to and self.upload_to.startswith("hf://") and self.upload_to.count("/") != 3:
            _fail("upload_to", f"write a Hub repository as hf://owner/repo (got {self.upload_to!r})")


@dataclass
class EvaluationArguments:
    """The monitor's evaluation of its checkpoints on the validation split (--validation_path)."""

    eval_every_checkpoints: int = field(
        default=1,
        metadata={"help": "Evaluate every this many saved checkpoints on --validation_path (checkpoints); 0: never"},
    )
    eval_max_examples: int = field(
        default=500,
        metadata={"help": "Largest number of validation examples one evaluation reads (examples)"},
    )

    def __post_init__(self) -> None:
        _require_positive(self, "eval_max_examples")
        _require_non_negative(self, "eval_every_checkpoints")


@dataclass
class PeerConfig:
    """Everything ``run_trainer.py`` takes, one group per concern; functions take this root or the group they need."""

    peer: PeerArguments
    optimizer: OptimizerArguments
    averager: AveragerArguments
    tracker: ProgressTrackerArguments
    collaboration: CollaborationArguments
    dataset: DatasetArguments
    training: TrainingArguments


@dataclass
class MonitorConfig:
    """Everything ``run_training_monitor.py`` takes, one group per concern."""

    peer: PeerArguments
    optimizer: OptimizerArguments
    averager: AveragerArguments
    dataset: DatasetArguments
    training: TrainingArguments
    metrics: MetricsArguments
    checkpoints: CheckpointArguments
    evaluation: EvaluationArguments


def argument_groups(config_type: type) -> tuple[type, ...]:
    """The argument dataclasses of a root config (``PeerConfig``) in the order of its fields: what the parser fills."""
    hints = get_type_hints(config_type)
    return tuple(hints[f.name] for f in dataclasses.fields(config_type))


TRAINER_ARGUMENTS: tuple[type, ...] = argument_groups(PeerConfig)
MONITOR_ARGUMENTS: tuple[type, ...] = argument_groups(MonitorConfig)
# Settings that are credentials: never shown in the web form nor stored in an experiment's config.
SECRET_SETTINGS = frozenset({"web_token"})
# Each machine's own settings: its paths (where it writes, what it loads) and the name its volunteer chooses. They
# come from its own command line or a local JSON file, never from a config URL: a web app must not pick files on a
# volunteer's disk (output_dir is replaced whole when the model is saved), nor give every peer one name.
LOCAL_SETTINGS = frozenset(
    {"identity_path", "events_path", "output_dir", "metrics_path", "repo_path", "resume_from", "public_name"}
)
# One experiment config (a JSON file or the web app's) holds the settings of both programs; each takes its own.
EXPERIMENT_ARGUMENTS: tuple[type, ...] = tuple(dict.fromkeys(TRAINER_ARGUMENTS + MONITOR_ARGUMENTS))


class _OneLineParser(HfArgumentParser):
    """argparse prints the whole usage before an error; we raise so the caller prints one line."""

    def error(self, message: str) -> None:
        # "argument --x_y/--x-y: invalid int value: 'a'" -> "--x_y: invalid int value: 'a'"
        raise ConfigError(re.sub(r"^argument (--\w+)(?:/--[\w-]+)*", r"\1", message))


def field_names(dataclass_types: Sequence[type]) -> dict[str, dataclasses.Field]:
    return {f.name: f for dtype in dataclass_types for f in dataclasses.fields(dtype)}


def config_to_argv(config: dict[str, Any], dataclass_types: Sequence[type], source: str = "config") -> list[str]:
    """Turn a JSON config into flags, so a config file and the command line share one parsing path."""
    if not isinstance(config, dict):
        raise ConfigError(f"{source}: expected a JSON object of settings, got {type(config).__name__}")
    known = field_names(dataclass_types)
    experiment_wide = field_names(EXPERIMENT_ARGUMENTS)
    argv: list[str] = []
    for key, value in config.items():
        if key not in known:
            if key in experiment_wide:
                continue  # a setting of the other program (trainer or monitor) in a shared experiment config
            raise ConfigError(f"--{key}: unknown setting in {source}; remove it or check the spelling (see --help)")
        if value is None:
            continue
        if isinstance(value, list):
            if not all(isinstance(item, (str, int, float)) for item in value):
                raise ConfigError(f"--{key}: in {source}, expected a list of plain values, got {value!r}")
            if any(str(item).startswith("-") for item in value):
                raise ConfigError(f"--{key}: in {source}, list items must not start with '-' (got {value!r})")
            if value:
                argv += [f"--{key}", *map(str, value)]
            elif known[key].default_factory is not dataclasses.MISSING and known[key].default_factory():
                raise ConfigError(f"--{key}: in {source}, give at least one value or leave the key out")
        elif isinstance(value, dict):
            raise ConfigError(f"--{key}: in {source}, expected a single value, got an object")
        else:
            # --key=value: a value that starts with '-' stays a value and is never read as another flag
            argv.append(f"--{key}={str(value).lower() if isinstance(value, bool) else value}")
    return argv


# A config is a few KiB of settings; the cap keeps a hostile URL or a wrong path (a disk image, /dev/zero) from
# filling memory, and the deadline keeps a server that sends a byte at a time from holding the program forever.
MAX_CONFIG_BYTES = 1 << 20
CONFIG_DOWNLOAD_TIMEOUT = 60.0


def _config_too_large(source: str) -> ConfigError:
    return ConfigError(f"--config: {source} is larger than {MAX_CONFIG_BYTES} bytes; give a JSON file of settings")


def _download_config(source: str, token: str | None) -> bytes:
    """The body at ``source``, at most MAX_CONFIG_BYTES, within CONFIG_DOWNLOAD_TIMEOUT seconds."""
    import time

    import requests

    # identity encoding, read raw: a compressed body could inflate far past the cap inside one read
    headers = {"Accept-Encoding": "identity", **bearer_header(token)}
    deadline = time.monotonic() + CONFIG_DOWNLOAD_TIMEOUT
    with requests.get(source, headers=headers, timeout=30, stream=True) as response:
        if response.status_code in (401, 403):
            raise ConfigError(f"--config: {source} refused access ({response.status_code}); check --config_token")
        response.raise_for_status()
        if int(response.headers.get("Content-Length") or 0) > MAX_CONFIG_BYTES:
            raise _config_too_large(source)
        body = bytearray()
        # read1 returns what has arrived (a read of N bytes would wait for all N from a server that drips them)
        while chunk := response.raw.read1(1 << 16, decode_content=False):
            body += chunk
            if len(body) > MAX_CONFIG_BYTES:
                raise _config_too_large(source)
            if time.monotonic() > deadline:
                raise ConfigError(f"--config: {source} took more than {CONFIG_DOWNLOAD_TIMEOUT:.0f} s to download")
        return bytes(body)


def _read_config_file(source: str) -> bytes:
    with Path(source).open("rb") as file:
        body = file.read(MAX_CONFIG_BYTES + 1)
    if len(body) > MAX_CONFIG_BYTES:
        raise _config_too_large(source)
    return body


def load_config(source: str, token: str | None = None) -> dict[str, Any]:
    """Read a JSON config (at most MAX_CONFIG_BYTES) from a file or an http(s) URL (the web app's
    /api/experiments/{id}/config)."""
    try:
        if is_url(source):
            return json.loads(_download_config(source, token))
        return json.loads(_read_config_file(source))
    except ConfigError:
        raise
    except FileNotFoundError:
        raise ConfigError(f"--config: no such file {source!r}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config: {source} is not valid JSON ({e})") from None
    except Exception as e:
        raise ConfigError(f"--config: could not read {source} ({e})") from None


def is_url(source: str) -> bool:
    return source.startswith(("http://", "https://"))


def flags_in(argv: Sequence[str]) -> set[str]:
    """``{"output_dir", ...}`` for ``["--output_dir=x", ...]``: the settings given on the command line."""
    return {item[2:].partition("=")[0] for item in argv if item.startswith("--")}


def without_local_settings(config: Any, source: str, given: set[str]) -> Any:
    """``config`` without LOCAL_SETTINGS; ConfigError naming the first one set to anything but its default (configs
    stored by older web apps list every key) unless the command line gives it (``given``) and so overrides it."""
    if not isinstance(config, dict):
        return config
    defaults = {name: f.default for name, f in field_names(EXPERIMENT_ARGUMENTS).items()}
    for key in sorted(LOCAL_SETTINGS & config.keys() - given):
        if config[key] is not None and config[key] != defaults.get(key):
            raise ConfigError(
                f"--{key}: a setting of this machine is never taken from a config URL ({source}); "
                "pass it on the command line",
                key,
            )
    return {key: value for key, value in config.items() if key not in LOCAL_SETTINGS}


def split_config_flags(argv: list[str]) -> tuple[str | None, str | None, list[str]]:
    """Take the config source (a leading *.json path or --config X) and --config_token out of argv."""
    config, token, rest = None, None, []
    items = iter(argv)
    for item in items:
        name, eq, inline = item.partition("=")
        if name in ("--config", "--config_token"):
            value = inline if eq else next(items, None)
            if value is None:
                raise ConfigError(f"{name}: expected a value")
            config, token = (value, token) if name == "--config" else (config, value)
        elif not rest and config is None and item.endswith(".json") and not item.startswith("-"):
            config = item
        else:
            rest.append(item)
    return config, token, rest


def parse_args(dataclass_types: Sequence[type], argv: Sequence[str] | None = None, prog: str | None = None):
    """Parse flags, a JSON config (a path or --config PATH_OR_URL) or both; flags given on the command line win.

    Raises ConfigError with a one-line message naming the flag on any bad input.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _OneLineParser(dataclass_types, prog=prog)
    parser.epilog = "A JSON config may be given first (config.json) or as --config PATH_OR_URL [--config_token T]."
    if "-h" in argv or "--help" in argv:
        parser.print_help()
        raise SystemExit(0)
    config_source, token, rest = split_config_flags(argv)
    config_argv = []
    if config_source:
        config = load_config(config_source, token)
        if is_url(config_source):
            config = without_local_settings(config, config_source, flags_in(rest))
        config_argv = config_to_argv(config, dataclass_types, config_source)
    try:
        return parser.parse_args_into_dataclasses(args=config_argv + rest)
    except ConfigError:
        raise
    except ValueError as e:  # HfArgumentParser: "Some specified arguments are not used ...: ['--x', '1']"
        leftover = re.findall(r"'([^']*)'", str(e).rpartition(":")[2])
        unknown = next((item for item in leftover if item.startswith("-")), leftover[0] if leftover else str(e))
        raise ConfigError(f"{unknown.partition('=')[0]}: unknown flag; check the spelling (see --help)") from e


def parse_args_or_exit(dataclass_types: Sequence[type], argv: Sequence[str] | None = None, prog: str = "") -> tuple:
    """parse_args for entry points: a bad setting prints one line and exits 2, never a traceback."""
    try:
        return parse_args(dataclass_types, argv, prog=prog)
    except ConfigError as e:
        from collab.entry import escape_control_characters  # collab.entry imports this module

        # A remote config's keys and values are in the message: they must not forge lines.
        print(f"{prog or 'error'}: error: {escape_control_characters(str(e))}", file=sys.stderr)
        raise SystemExit(2) from None


def validate_config(config: dict[str, Any], dataclass_types: Sequence[type] = EXPERIMENT_ARGUMENTS) -> tuple:
    """The dataclass instances for a config dict, through the same path as the command line (the web form uses it).

    Raises ConfigError whose ``field`` names the setting to fix.
    """
    return parse_args(dataclass_types, config_to_argv(config, dataclass_types))


def to_config(*arguments: Any) -> dict[str, Any]:
    """The JSON config equivalent to these dataclass instances (the inverse of parse_args)."""
    return {key: value for args in arguments for key, value in dataclasses.asdict(args).items()}
