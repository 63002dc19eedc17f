"""Emulated wide-area network: peers in their own network namespaces behind shaped access links, bytes counted by
the kernel. ``python -m bench.wan [--quick]`` (also ``python -m bench --only wan``); the last line is one JSON object.

Two ways stand for GPU peers on these CPUs, and every figure says which one it used:

- *rate scaling* (real compute, ``run_trainer.py``): the links are shaped so that a synchronous round's time over an
  epoch's compute time equals that of the setting represented (``SETTING``); the CPU's compute time per epoch is
  measured in the same run, by the same peers training alone.
- *shadow compute* (``bench.shadow``): forward and backward are a calibrated wait, the gradients have GPT-2 small's
  shapes, so real-size payloads cross a link shaped to the setting's own rate. Utilisation and traffic only.

This kernel has no ``sch_netem``: the links add no delay or loss, only a bandwidth limit (tbf).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import signal
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.formulas import MBIT, allreduce_bytes_per_peer, mean, median, ratio, rounded
from bench.procs import (
    ONE_THREAD,
    TRANSPORTS,
    Child,
    HubNetwork,
    NamespacesUnavailable,
    children,
    hub_network,
    read_json_lines,
    wait_for,
)
from collab.compression import CODEC_KINDS, make_codec
from collab.lowcomm import round_target_samples

FLOPS_PER_PARAM_TOKEN = 6  # forward and backward of a transformer: 6 FLOPs per parameter per token
# H of any bench run (the trainer takes more): a round of 1000 x 256 samples already outlasts a loss run's samples,
# and a window's many times over
MAX_BENCH_LOCAL_STEPS = 1000
FAST_LINK_MBIT = 1000.0  # joining (state download) and the loss runs: the link is not what these measure
SUMMARY_KEYS = ("wan_efficiency_sync", "wan_efficiency_lowcomm", "bits_per_param_per_step", "lowcomm_loss_ratio")
# Beside them, the share of the time the peers computed (``busy_fraction``), the figure OpenDiLoCo and INTELLECT-1
# report as compute utilisation: it leaves out what efficiency also counts, peers sharing these few cores.
BUSY_KEYS = ("wan_busy_sync", "wan_busy_lowcomm")
# An interval between two of a peer's steps longer than this many times its median interval is waiting (a round, a
# state download) beyond its own pace.
WAIT_FACTOR = 2.0


@dataclasses.dataclass(frozen=True)
class Setting:
    """A swarm of GPU peers on the internet, the thing the emulation stands for."""

    name: str
    params: int
    gpu_flops: float  # sustained FLOP/s of one peer
    link_mbit: float  # each peer's access link, each way
    tokens_per_peer_per_epoch: int
    peers: int

    def __post_init__(self) -> None:
        for name in ("params", "gpu_flops", "link_mbit", "tokens_per_peer_per_epoch"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, not {getattr(self, name)}")
        if self.peers < 2:
            raise ValueError(f"peers must be 2 or more, not {self.peers}")


# sahajBERT's batch (4096 sequences of 128 tokens a global step) shared by three peers.
SETTING = Setting(
    "BERT-base (110M parameters), 60 TFLOP/s per GPU, 100 Mbit/s links, 4096 x 128 tokens per step, 3 peers",
    params=110_000_000,
    gpu_flops=60e12,
    link_mbit=100.0,
    tokens_per_peer_per_epoch=4096 * 128 // 3,
    peers=3,
)
# GPT-2 small, 16 sequences of 1024 tokens per micro-batch, on the setting's GPU and link.
SHADOW_TOKENS_PER_MICRO_BATCH = 16 * 1024


def compute_s(params: int, tokens: int, gpu_flops: float) -> float:
    """Seconds of forward and backward over ``tokens`` tokens: 6·P·tokens / FLOP/s."""
    return FLOPS_PER_PARAM_TOKEN * params * tokens / gpu_flops


def comm_to_compute(setting: Setting) -> float:
    """R: a synchronous fp16 all-reduce round's time over one epoch's compute time, in the setting represented."""
    round_s = allreduce_bytes_per_peer(setting.params, setting.peers) / (setting.link_mbit * MBIT)
    return round_s / compute_s(setting.params, setting.tokens_per_peer_per_epoch, setting.gpu_flops)


def scaled_rate_mbit(setting: Setting, params: int, epoch_compute_s: float) -> float:
    """The link rate at which ``params`` parameters, computed in ``epoch_compute_s`` per epoch on this machine, have
    the setting's ratio R of a synchronous round's time to an epoch's compute (same number of peers)."""
    if not params > 0 or not epoch_compute_s > 0:
        raise ValueError(f"params and epoch_compute_s must be positive, not {params} and {epoch_compute_s}")
    round_s = comm_to_compute(setting) * epoch_compute_s
    return allreduce_bytes_per_peer(params, setting.peers) / round_s / MBIT


def bits_per_param_per_step(sent_and_received_bytes: float, params: int, steps: float) -> float | None:
    """A peer's link traffic, both directions, in bits per model parameter per inner step."""
    if not params > 0 or not steps > 0:
        return None
    return sent_and_received_bytes * 8 / params / steps


@dataclasses.dataclass(frozen=True)
class Window:
    """What the peers did between two instants: samples/s of all together, and each peer's steps and epochs."""

    samples_per_second: float
    records: list[int]  # optimizer.step calls (inner steps with accumulation 1) of each peer
    epochs: list[int]  # global epochs each peer entered
    busy: list[float | None]  # each peer's busy_fraction


def busy_fraction(times: Sequence[float], start: float, end: float) -> float | None:
    """The share of ``(start, end]`` a peer spent computing at its own pace, from the times of its steps in it: each
    interval (from ``start`` to the first step, between steps, from the last to ``end``) counts up to WAIT_FACTOR
    times the median interval between its steps; the rest was waiting. None with fewer than 3 steps inside."""
    inside = sorted(t for t in times if start < t <= end)
    if len(inside) < 3:
        return None
    pace = statistics.median(b - a for a, b in zip(inside, inside[1:], strict=False))
    edges = [start, *inside, end]
    computing = sum(min(b - a, WAIT_FACTOR * pace) for a, b in zip(edges, edges[1:], strict=False))
    return computing / (end - start)


def window_figures(peers_steps: Sequence[Sequence[Sequence[float]]], start: float, end: float) -> Window:
    """From each peer's ``[time, samples, epoch]`` records (``bench.probe``), the part inside ``(start, end]``."""
    if not end > start:
        raise ValueError(f"an empty window: {start} to {end}")
    inside = [[step for step in steps if start < step[0] <= end] for steps in peers_steps]
    samples = sum(step[1] for steps in inside for step in steps)
    epochs = []
    for steps, within in zip(peers_steps, inside, strict=True):
        before = [step[2] for step in steps if step[0] <= start]
        first = before[-1] if before else (within[0][2] if within else 0)
        epochs.append(int(within[-1][2] - first) if within else 0)
    busy = [busy_fraction([step[0] for step in steps], start, end) for steps in peers_steps]
    return Window(samples / (end - start), [len(steps) for steps in inside], epochs, busy)


def lowcomm_flags(local_steps: int, compression: str) -> list[str]:
    """The low-communication mode's flags (``run_trainer.py``): DiLoCo's outer Nesterov SGD, 0.7 and 0.9."""
    return [
        "--local_steps",
        str(local_steps),
        "--outer_learning_rate",
        "0.7",
        "--outer_momentum",
        "0.9",
        "--pseudo_grad_compression",
        compression,
    ]


def variant(local_steps: int, compression: str) -> tuple[str, list[str]]:
    """A low-communication run of the rate-scaled way: its name in the report, and its flags."""
    return f"H {local_steps}, {compression}", lowcomm_flags(local_steps, compression)


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``H:COMPRESSION`` (``25:8bit``), or ``H:topk:FRACTION`` (``25:topk:0.01``, top-k's ``--topk_fraction``), as a
    variant; ValueError naming what to write instead."""
    h, _, rest = text.partition(":")
    compression, colon, fraction = rest.partition(":")
    h_ok = h.isascii() and h.isdigit() and 1 <= int(h) <= MAX_BENCH_LOCAL_STEPS
    fraction_ok = not colon or (compression == "topk" and _is_topk_fraction(fraction))
    if not h_ok or compression not in CODEC_KINDS or not fraction_ok:
        kinds = ", ".join(CODEC_KINDS)
        raise ValueError(
            f"{text!r} must be H:COMPRESSION or H:topk:FRACTION, H 1 to {MAX_BENCH_LOCAL_STEPS}, compression one of "
            f"{kinds}, FRACTION in (0, 1]"
        )
    name, flags = variant(int(h), compression)
    if colon:
        return f"{name} {float(fraction):g}", [*flags, "--topk_fraction", f"{float(fraction):g}"]
    return name, flags


def _is_topk_fraction(text: str) -> bool:
    """Whether ``text`` is a plain number that ``--topk_fraction`` takes (``make_codec`` holds the rule)."""
    try:
        make_codec("topk", topk_fraction=float(text))
    except ValueError:
        return False
    return text.isascii()


@dataclasses.dataclass
class Plan:
    """How long each run lasts and what it covers; ``QUICK`` is a smoke run of a few minutes."""

    peers: int = 3
    target_batch_size: int = 256
    seconds: float = 60.0  # measured window of each throughput run; together, two whole epochs at least
    lowcomm_variants: dict = dataclasses.field(default_factory=dict)
    loss_steps_per_peer: int = 1000  # inner steps (micro-batches of 16) of each peer in each loss run
    # 124M-parameter shadow peers hold about 8 GB each (proportional set size while averaging, 64 bytes a
    # parameter): two fit in 24 GB beside everything else, three do not.
    shadow_peers: int = 2
    shadow_layers: int = 12
    shadow_seconds: float = 60.0  # as ``seconds``, for the shadow runs
    # lowcomm_state_every_2, the parameter rounds of before 2026-11-26, runs when named (--shadow_modes)
    shadow_modes: tuple[str, ...] = ("alone", "sync", "lowcomm_alone", "lowcomm", "lowcomm_topk", "lowcomm_long")
    shadow_topk_fraction: float | None = None  # None: the trainer's default
    loss_variant: tuple[str, ...] = tuple(lowcomm_flags(50, "8bit"))
    # every real-compute run and the plain reference: at target 256 the default rate (0.2) plateaus, then diverges
    # in both modes near 45,000 samples (docs/benchmarks/2026-11-26-amd-epyc-2core-wan-loss.md); 0.05 trains
    loss_flags: tuple[str, ...] = ("--learning_rate", "0.05")
    transport: str = "tcp"  # what the peers listen on (bench.procs.TRANSPORTS)


# A round ends when the swarm has processed H x target_batch_size samples, so each of 3 peers takes H x 256 / (3 x 16)
# inner steps between rounds: 267 at H 50, where 8 bits both ways (2 x 2(N-1)/N x 8 bits) make 0.08 bits per
# parameter per inner step. H 10 runs in the shadow way, where its rounds last what the setting's would. Top-k
# runs there too, on 124M parameters: on the default model's 1M the swarm's control traffic outweighs its rounds
# (docs/benchmarks/2026-11-28-intel-xeon-2core-wan-rate-scaled-after-architecture.md); --lowcomm_variants adds it.
FULL = Plan(lowcomm_variants=dict([variant(50, "8bit")]))
QUICK = Plan(
    seconds=30.0,
    lowcomm_variants=dict([variant(5, "8bit")]),
    loss_steps_per_peer=60,
    loss_variant=tuple(lowcomm_flags(5, "8bit")),
    shadow_peers=2,
    shadow_layers=2,
    shadow_seconds=30.0,
)


def progress_ticks(plan: Plan) -> int:
    """How many times ``measure`` reports progress: alone, synchronous, each variant, two loss runs, each shadow
    run."""
    return 4 + len(plan.lowcomm_variants) + len(plan.shadow_modes)


def trainer_has_flag(name: str) -> bool:
    """Whether ``run_trainer.py`` takes ``--name`` (the low-communication mode's ``--local_steps``, say)."""
    from arguments import TRAINER_ARGUMENTS

    return any(field.name == name for group in TRAINER_ARGUMENTS for field in dataclasses.fields(group))


def round_counts(events_path: Path, start: float, end: float, event: str, parameters: bool = False) -> int | None:
    """A peer's ``averaged`` gradient (or pseudo-gradient) rounds, its parameter rounds (``parameters``), or its
    ``round_given_up`` events, between ``start`` and ``end``, from its events file; None where it wrote none."""
    if not events_path.exists():
        return None
    from collab.events import read_events

    records = read_events(events_path, event)
    return sum(1 for r in records if (r.get("kind") == "parameters") == parameters and start < r["time"] <= end)


def link_flags(rate_mbit: float) -> list[str]:
    """The peers' ``--bandwidth``: their rounds' and downloads' timeouts are derived from it and the model
    (``collab.timeouts``), as a volunteer's would be."""
    return ["--bandwidth", f"{rate_mbit:.4g}"]


def default_model_params() -> int:
    """Parameters of the model ``run_trainer.py`` trains at its defaults."""
    from arguments import DatasetArguments, TrainingArguments
    from trainer.model import build_model, load_tokenizer

    dataset_args = DatasetArguments()
    model, _ = build_model(dataset_args, load_tokenizer(dataset_args), TrainingArguments().seed)
    return sum(param.numel() for param in model.parameters())


MAX_WINDOW_S = 600.0
WARM_UP_STEPS = 5  # steps each peer of an alone run takes before its window opens


def window_closed(elapsed: float, seconds: float, whole_epochs: int | None) -> bool:
    """Whether a measured window may end: ``seconds`` passed and, for peers together (``whole_epochs``: global epochs
    the swarm began since the window opened), two whole epochs, so that it holds whole averaging rounds; at
    ``MAX_WINDOW_S`` in any case."""
    if elapsed >= MAX_WINDOW_S:
        return True
    return elapsed >= seconds and (whole_epochs is None or whole_epochs >= 2)


def run_swarm(
    network: HubNetwork,
    name: str,
    flags: list[str],
    log_dir: Path,
    seconds: float,
    together: bool = True,
    module: str = "bench.probe",
    rate_mbit: float | None = None,
    stop_at_epoch: int | None = None,
    timeout: float = 1200,
    transport: str = "tcp",
) -> dict:
    """One process per peer, each in its namespace; ``together``: one swarm, else each alone (own experiment); the
    peers listen on ``transport`` (a key of ``bench.procs.TRANSPORTS``).

    Peers start on a fast link (a newcomer's state download is not measured); once every peer is training, the links
    are shaped to ``rate_mbit``, the slowest peer enters its next epoch (alone: each peer's first steps), and then
    ``seconds`` or more are measured (``window_closed``): samples/s of all the peers and each peer's link bytes by
    the kernel's counters. With ``stop_at_epoch`` the peers instead train until that global epoch (``--max_steps``),
    where each one saves its model and leaves by itself, and their saved models are returned; the window then runs
    from epoch 1 to the first peer's last.
    """
    stamp = int(time.time())
    steps = [log_dir / f"{name}_{rank}.steps.jsonl" for rank in range(len(network.peers))]
    events = [log_dir / f"{name}_{rank}.events.jsonl" for rank in range(len(network.peers))]
    outputs = [log_dir / f"{name}_{rank}_model" for rank in range(len(network.peers))]
    for path in steps + events:
        path.unlink(missing_ok=True)
    barrier = module == "bench.shadow"  # shadow peers start stepping together (see bench.shadow --start_file)
    start_file = log_dir / f"{name}.start"
    ready = [log_dir / f"{name}_{rank}.ready" for rank in range(len(network.peers))]
    for path in [start_file, *ready]:
        path.unlink(missing_ok=True)
    network.set_rates(FAST_LINK_MBIT, FAST_LINK_MBIT)

    def records():
        return [read_json_lines(path) for path in steps]

    with children() as started:
        join: list[str] = []
        for rank, peer in enumerate(network.peers):
            prefix = f"wan_{name}_{stamp}" + ("" if together else f"_{rank}")
            argv = [steps[rank], "--experiment_prefix", prefix, "--host_maddrs", peer.listen_maddr(transport), *flags]
            if stop_at_epoch:
                argv += ["--max_steps", str(stop_at_epoch)]
            child = Child(
                module,
                [
                    *argv,
                    *join,
                    "--output_dir",
                    outputs[rank],
                    *(["--ready_file", ready[rank], "--start_file", start_file] if barrier else []),
                ],
                log_dir / f"{name}_{rank}.log",
                timeout,
                env=ONE_THREAD,
                netns=peer.netns,
                events_path=events[rank],
            )
            started.append(child)
            if together and not join:
                join = child.join_flags(180)
        if barrier:
            wait_for(lambda: all(path.exists() for path in ready), 600, f"{name}: every peer ready", 1, started)
            start_file.touch()
        wait_for(lambda: all(records()), 300, f"{name}: every peer training", 1, started)
        if rate_mbit is not None:
            network.set_rates(rate_mbit, rate_mbit)
        if together and not stop_at_epoch:
            shaped_epoch = max(steps[-1][2] for steps in records())
            wait_for(lambda: min(s[-1][2] for s in records()) > shaped_epoch, 900, f"{name}: an epoch", 1, started)
        elif not together:
            # alone, a peer averages nothing: past its first steps its rate is steady, whatever its epoch's length
            wait_for(lambda: min(map(len, records())) >= WARM_UP_STEPS, 300, f"{name}: warmed up", 1, started)
        if stop_at_epoch and stop_at_epoch > 1:
            # the window holds the rounds between every peer's first and the first peer's last: no start-up, no
            # shutdown, the links busy as in the throughput runs
            wait_for(lambda: min(s[-1][2] for s in records()) >= 1, timeout, f"{name}: a round", 1, started)

        def kernel_counters() -> tuple[float, list[dict[str, int]], list[dict[str, int]]]:
            """The time, then each peer's link bytes and TCP counters: read together at each end of the window."""
            return time.time(), network.counters(), network.tcp_counters()

        start, counters, tcp = kernel_counters()
        if stop_at_epoch:

            def finished() -> bool:
                return max(s[-1][2] for s in records()) >= stop_at_epoch or not any(c.running() for c in started)

            wait_for(finished, timeout, f"{name}: epoch {stop_at_epoch}", 1, started)
            end, counters_end, tcp_end = kernel_counters()
            # stopped together by a signal, peers waiting on each other's last rounds ran past their shutdown deadline
            codes = [child.wait() for child in started]
        else:
            opened = max(s[-1][2] for s in records())

            def closed() -> bool:
                # the swarm's epochs: a peer out of sync, waiting on a state download, lags and does not hold it up
                whole = int(max(s[-1][2] for s in records()) - opened) if together else None
                return window_closed(time.time() - start, seconds, whole)

            wait_for(closed, MAX_WINDOW_S + 60, f"{name}: the window", 1, started)
            end, counters_end, tcp_end = kernel_counters()
            with concurrent.futures.ThreadPoolExecutor(len(started)) as pool:  # all at once: none trains on meanwhile
                codes = list(pool.map(lambda child: child.terminate(), started))
    window = window_figures(records(), start, end)
    traffic = [
        (after["tx_bytes"] - before["tx_bytes"]) + (after["rx_bytes"] - before["rx_bytes"])
        for before, after in zip(counters, counters_end, strict=True)
    ]
    return {
        "samples_per_second": window.samples_per_second,
        "window_s": end - start,
        "records": window.records,
        "epochs": window.epochs,
        "busy_fraction": median([busy for busy in window.busy if busy is not None]),
        "link_bytes": traffic,
        "tcp": [{key: after[key] - before[key] for key in after} for before, after in zip(tcp, tcp_end, strict=True)],
        "samples": [sum(s[1] for s in peer) for peer in records()],
        # a round given up lets a peer go on with its own gradients: a swarm that averages rarely looks fast
        "averaging_rounds": [round_counts(path, start, end, "averaged") for path in events],
        "rounds_given_up": [round_counts(path, start, end, "round_given_up") for path in events],
        # a window of the low-communication mode may hold none of its rare parameter rounds, and look faster
        "parameter_rounds": [round_counts(path, start, end, "averaged", parameters=True) for path in events],
        "exit_codes": codes,
        "models": outputs,
        "steps_files": steps,
    }


def traffic_bits(run: dict, params: int, per_epoch: bool) -> float | None:
    """Median over the peers of bits per parameter per step; a synchronous step is a global epoch."""
    steps = run["epochs"] if per_epoch else run["records"]
    values = [bits_per_param_per_step(b, params, s) for b, s in zip(run["link_bytes"], steps, strict=True)]
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def variants_by_local_steps(variants: dict[str, list[str]]) -> dict[str, list[tuple[str, list[str]]]]:
    """The low-communication variants grouped by their ``--local_steps`` (H), in the order each H first appears:
    the variants of one H run between the same two alone runs."""
    groups: dict[str, list[tuple[str, list[str]]]] = {}
    for variant, flags in variants.items():
        groups.setdefault(flags[flags.index("--local_steps") + 1], []).append((variant, flags))
    return groups


def bracketed_rate(before: dict, after: dict) -> float | None:
    """The samples/s of peers alone over the time between two alone runs: the mean of the two, or the one that
    measured where the other did not."""
    return mean([run["samples_per_second"] for run in (before, after) if run.get("samples_per_second") is not None])


def _public(run: dict) -> dict:
    return {key: value for key, value in run.items() if key not in ("models", "steps_files")}


def rate_scaled(plan: Plan, log_dir: Path, progress: Callable[[str], None], with_loss: bool = False) -> dict:
    """Real compute, rate scaling: alone, synchronous, then the low-communication variants of each H between an alone
    run in that mode before and one after them, on one hub network.
    ``with_loss``: the variant that is the loss way's ``loss_variant`` runs as that way's low-communication side
    (whole rounds, models saved; ``loss_run``), its window from every peer's first round to the first peer's last,
    and the run is returned under ``"loss_run"`` too."""
    params = default_model_params()
    common = loss_common_flags(plan)
    with hub_network(plan.peers, FAST_LINK_MBIT, FAST_LINK_MBIT) as network:
        alone = run_swarm(network, "alone", common, log_dir, plan.seconds, together=False, transport=plan.transport)
        progress("wan: alone")
        epoch_compute_s = plan.target_batch_size / alone["samples_per_second"]
        rate = scaled_rate_mbit(SETTING, params, epoch_compute_s)
        slow = [*common, *link_flags(rate)]
        sync = run_swarm(network, "sync", slow, log_dir, plan.seconds, rate_mbit=rate, transport=plan.transport)
        progress("wan: synchronous")
        lowcomm: dict = dict.fromkeys(plan.lowcomm_variants)  # the plan's order, whatever order they run in
        loss = None
        available = trainer_has_flag("local_steps")
        swarms = 0  # the low-communication swarms run so far: each one's name
        for h, variants in (variants_by_local_steps(plan.lowcomm_variants) if available else {}).items():
            # the same peers alone in the same mode, before and after the variants of this H: their inner steps cost
            # what they cost in the swarm, and the mean of the two stands for the time between them on this shared
            # machine, whose speed drifts (docs/benchmarks/2026-12-03-amd-epyc-2core-bracketed-alone.md). Alone a
            # peer averages nothing, so variants that differ only in compression share them.
            alone_flags = [*common, *variants[0][1]]
            before = run_swarm(
                network,
                f"lowcomm_h{h}_alone",
                alone_flags,
                log_dir,
                plan.seconds,
                together=False,
                transport=plan.transport,
            )
            runs = {}
            for variant, flags in variants:
                if with_loss and tuple(flags) == plan.loss_variant and loss is None:
                    runs[variant] = loss = loss_run(network, plan, log_dir, rate, link_flags(rate))
                else:
                    runs[variant] = run_swarm(
                        network,
                        f"lowcomm{swarms}",
                        [*slow, *flags],
                        log_dir,
                        plan.seconds,
                        rate_mbit=rate,
                        transport=plan.transport,
                    )
                swarms += 1
                progress(f"wan: {variant}")
            after = run_swarm(
                network,
                f"lowcomm_h{h}_alone_after",
                alone_flags,
                log_dir,
                plan.seconds,
                together=False,
                transport=plan.transport,
            )
            reference = bracketed_rate(before, after)
            for variant, run in runs.items():
                lowcomm[variant] = _public(run) | {
                    "alone": _public(before),
                    "alone_after": _public(after),
                    "alone_samples_per_second": reference,
                    "efficiency": ratio(run["samples_per_second"], reference),
                    "bits_per_param_per_step": traffic_bits(run, params, per_epoch=False),
                }
        if not available:
            for variant in lowcomm:
                progress(f"wan: {variant}")
        congestion_control = network.congestion_control()
    return {
        "params": params,
        "congestion_control": congestion_control,
        "transport": plan.transport,
        "epoch_compute_s": epoch_compute_s,
        "comm_to_compute": comm_to_compute(SETTING),
        "rate_mbit": rate,
        "alone": _public(alone),
        "sync": _public(sync)
        | {
            "efficiency": ratio(sync["samples_per_second"], alone["samples_per_second"]),
            "bits_per_param_per_step": traffic_bits(sync, params, per_epoch=True),
        },
        "lowcomm": lowcomm,
        "lowcomm_available": available,
        **({"loss_run": loss} if loss else {}),
    }


LOSS_RUN_S = 3600.0  # at most, each loss run


def outer_rounds_for(samples: int, local_steps: int, target_batch_size: int) -> int:
    """Outer rounds of ``local_steps x target_batch_size`` samples that hold at least ``samples``: the loss runs stop
    at a round's end, the synchronous one after as many global batches (``local_steps`` epochs a round)."""
    return max(1, math.ceil(samples / round_target_samples(local_steps, target_batch_size)))


def loss_at_equal_samples(
    plan: Plan, log_dir: Path, progress: Callable[[str], None], lowcomm: dict | None = None
) -> dict | None:
    """Real compute: ``plan.loss_variant`` trains the default model for at least ``loss_steps_per_peer`` micro-batches
    of 16 per peer (whole outer rounds: ``outer_rounds_for``), then the synchronous mode's updates over as many
    samples, and the ratio of their held-out losses. ``lowcomm``: that run already made (the rate-scaled way runs it
    on its links), else it runs here on fast links. The synchronous side is ``bench.plain reference``: one process,
    Lamb over global batches of ``target_batch_size``, the loop make bench's parity figure matches to a synchronous
    swarm, stopped at the batch nearest the low-communication swarm's samples. None where ``run_trainer.py`` has no
    low-communication mode."""
    from bench.training import held_out_loss, reference_loss

    if not trainer_has_flag("local_steps"):
        return None
    links = "the rate-scaled way's links" if lowcomm else f"{FAST_LINK_MBIT:g} Mbit/s links"
    if lowcomm is None:
        with hub_network(plan.peers, FAST_LINK_MBIT, FAST_LINK_MBIT, prefix="wanls", subnet="10.78.2") as network:
            lowcomm = loss_run(network, plan, log_dir)
    progress("wan: loss, lowcomm")
    losses = saved_losses(lowcomm, held_out_loss)
    equal = sum(lowcomm["samples"])
    batches = max(1, round(equal / plan.target_batch_size))
    reference = reference_loss(batches, plan.target_batch_size, log_dir, plan.loss_flags, timeout=LOSS_RUN_S)
    progress("wan: loss, sync")
    return {
        "lowcomm": losses,
        "sync": {"global_batches": batches, "samples": batches * plan.target_batch_size, "loss": reference},
        "ratio": ratio(mean(losses["losses"]), reference),
        "variant": " ".join(plan.loss_variant),
        "common": " ".join(loss_common_flags(plan)),
        "links": links,
    }


def loss_common_flags(plan: Plan) -> list[str]:
    """Flags of both sides of the loss ratio, and of the rate-scaled run that doubles as its low-communication side."""
    return ["--target_batch_size", str(plan.target_batch_size), *plan.loss_flags]


def loss_run(
    network: HubNetwork, plan: Plan, log_dir: Path, rate_mbit: float | None = None, flags: Sequence[str] = ()
) -> dict:
    """The loss ratio's low-communication side: whole outer rounds of ``plan.loss_variant`` holding at least
    ``loss_steps_per_peer`` micro-batches a peer, each peer saving its model at the end; on links shaped to
    ``rate_mbit`` (with the peers' ``flags``: their ``--bandwidth``) where given."""
    local_steps = int(plan.loss_variant[plan.loss_variant.index("--local_steps") + 1])
    rounds = outer_rounds_for(plan.loss_steps_per_peer * plan.peers * 16, local_steps, plan.target_batch_size)
    return run_swarm(
        network,
        "loss_lowcomm",
        [*loss_common_flags(plan), *flags, *plan.loss_variant],
        log_dir,
        0,
        rate_mbit=rate_mbit,
        stop_at_epoch=rounds,
        timeout=LOSS_RUN_S,
        transport=plan.transport,
    )


def saved_losses(run: dict, held_out_loss: Callable[[Path], float]) -> dict:
    """A loss run's samples per peer, exit codes and the held-out loss of each model saved (a peer whose clean
    shutdown ran past its deadline saved none)."""
    saved = [folder for folder in run["models"] if (Path(folder) / "config.json").exists()]
    return {"samples": run["samples"], "exit_codes": run["exit_codes"], "losses": [held_out_loss(f) for f in saved]}


# H of the shadow run's low-communication mode: an outer round every 10 global batches (about 30 s of compute at
# the setting), so that rounds complete within the measured window.
SHADOW_LOCAL_STEPS = 10
# The 8-bit run again at this H, for the table over H: an 8-bit round moves 2 x 2(N-1)/N x 8.06 bits a parameter
# (16.1 with 2 peers) over 16 H inner steps a peer, so 0.1 bits a parameter an inner step needs H 11 or more.
SHADOW_LONG_LOCAL_STEPS = 20


# Each mode is divided by the same peers alone in that mode (alone, a peer averages nothing: one alone run serves
# every compression).
SHADOW_ALONE_RUN = {
    "sync": "alone",
    "lowcomm": "lowcomm_alone",
    "lowcomm_topk": "lowcomm_alone",
    "lowcomm_state_every_2": "lowcomm_alone",
    "lowcomm_long": "lowcomm_alone",
}


def shadow_runs(
    local_steps: int, topk_fraction: float | None = None, long_local_steps: int = SHADOW_LONG_LOCAL_STEPS
) -> dict[str, tuple[bool, list[str]]]:
    """The shadow way's runs in order: {name: (peers together, their own flags)}. One alone run in the
    low-communication mode serves every H: alone, a peer's outer step is a local copy."""
    lowcomm = lowcomm_flags(local_steps, "8bit")
    topk = lowcomm_flags(local_steps, "topk")
    if topk_fraction is not None:
        topk += ["--topk_fraction", f"{topk_fraction:g}"]
    return {
        "alone": (False, []),
        "sync": (True, []),
        "lowcomm_alone": (False, lowcomm),
        "lowcomm": (True, lowcomm),
        # top-k's traffic where the swarm's control traffic is a negligible share of it (a 124M-parameter model)
        "lowcomm_topk": (True, topk),
        "lowcomm_long": (True, lowcomm_flags(long_local_steps, "8bit")),
        # the low-communication mode's parameter rounds as often as the synchronous mode's, as before 2026-11-26
        "lowcomm_state_every_2": (True, [*lowcomm, "--average_state_every", "2"]),
    }


def shadow(plan: Plan, log_dir: Path, progress: Callable[[str], None]) -> dict:
    """Shadow compute: GPT-2-shaped gradients over links at the setting's own rate, alone and together."""
    from bench.shadow import shadow_numel

    numel = shadow_numel(plan.shadow_layers)
    micro_s = compute_s(numel, SHADOW_TOKENS_PER_MICRO_BATCH, SETTING.gpu_flops)
    flags = ["--layers", str(plan.shadow_layers), "--micro_batch_s", f"{micro_s:.4f}"]
    flags += ["--target_batch_size", str(16 * 16 * plan.shadow_peers)]
    flags += link_flags(SETTING.link_mbit)
    with hub_network(plan.shadow_peers, FAST_LINK_MBIT, FAST_LINK_MBIT, prefix="wansh", subnet="10.78.1") as network:
        runs = {}
        for mode, (together, extra) in shadow_runs(SHADOW_LOCAL_STEPS, plan.shadow_topk_fraction).items():
            if mode not in plan.shadow_modes:
                continue
            runs[mode] = run_swarm(
                network,
                f"shadow_{mode}",
                [*flags, *extra],
                log_dir,
                plan.shadow_seconds,
                together=together,
                module="bench.shadow",
                rate_mbit=SETTING.link_mbit,
                transport=plan.transport,
            )
            progress(f"wan: shadow {mode}")
        congestion_control = network.congestion_control()
    return {
        "params": numel,
        "congestion_control": congestion_control,
        "transport": plan.transport,
        "micro_batch_s": micro_s,
        "rate_mbit": SETTING.link_mbit,
        "local_steps": SHADOW_LOCAL_STEPS,
        "long_local_steps": SHADOW_LONG_LOCAL_STEPS,
        "topk_fraction": plan.shadow_topk_fraction,
        **({"alone": _public(runs["alone"])} if "alone" in runs else {}),
        **shadow_together(runs, numel),
    }


def shadow_together(runs: dict, numel: int) -> dict:
    """Each together run of the shadow way with its alone run, efficiency (None where ``--shadow_modes`` left the
    alone run out) and traffic."""
    together = {}
    for mode, alone_run in SHADOW_ALONE_RUN.items():
        if mode not in runs:
            continue
        alone = runs.get(alone_run)
        together[mode] = _public(runs[mode]) | {
            "alone": alone and _public(alone),
            "efficiency": alone and ratio(runs[mode]["samples_per_second"], alone["samples_per_second"]),
            # a synchronous step is a global epoch, a low-communication one an inner step
            "bits_per_param_per_step": traffic_bits(runs[mode], numel, per_epoch=mode == "sync"),
        }
    return together


WAYS = ("rate_scaled", "shadow", "loss")


def measure(
    plan: Plan, log_dir: Path, progress: Callable[[str], None] = lambda _: None, ways: Sequence[str] = tuple(WAYS)
) -> dict:
    """The wan part's figures; ``{"skipped": reason}`` where network namespaces are not allowed."""
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        figures: dict = {"setting": dataclasses.asdict(SETTING)}
        if "rate_scaled" in ways:
            figures["rate_scaled"] = rate_scaled(plan, log_dir, progress, with_loss="loss" in ways)
        if "shadow" in ways:
            figures["shadow"] = shadow(plan, log_dir, progress)
        if "loss" in ways:
            lowcomm = figures.get("rate_scaled", {}).pop("loss_run", None)
            figures["loss"] = loss_at_equal_samples(plan, log_dir, progress, lowcomm)
        return figures
    except NamespacesUnavailable as e:
        return {"skipped": str(e)}


def summarize(wan: dict) -> dict:
    """The four summary figures and BUSY_KEYS; the best low-communication variant stands for the mode."""
    summary: dict = {key: None for key in (*SUMMARY_KEYS, *BUSY_KEYS)}
    bits: dict = {}
    if wan.get("shadow"):
        for mode in ("sync", "lowcomm", "lowcomm_topk", "lowcomm_long"):
            if mode in wan["shadow"]:
                bits[f"shadow_{mode}"] = wan["shadow"][mode]["bits_per_param_per_step"]
    scaled = wan.get("rate_scaled")
    if scaled:
        variants = [run for run in scaled["lowcomm"].values() if run]
        best = max(variants, key=lambda run: run["efficiency"] or 0, default=None)
        bits["sync"] = scaled["sync"]["bits_per_param_per_step"]
        bits |= {name: run["bits_per_param_per_step"] for name, run in scaled["lowcomm"].items() if run}
        summary["wan_efficiency_sync"] = scaled["sync"]["efficiency"]
        summary["wan_efficiency_lowcomm"] = best and best["efficiency"]
        summary["wan_busy_sync"] = scaled["sync"].get("busy_fraction")
        summary["wan_busy_lowcomm"] = best and best.get("busy_fraction")
    if wan.get("loss"):
        summary["lowcomm_loss_ratio"] = wan["loss"]["ratio"]
    summary["bits_per_param_per_step"] = bits or None
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.wan", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few minutes, fewer and shorter runs")
    parser.add_argument("--log_dir", type=Path, default=Path("outputs/bench/wan"), help="every process's log")
    parser.add_argument("--output", type=Path, default=None, help="also write every figure as JSON here")
    parser.add_argument(
        "--transport",
        choices=sorted(TRANSPORTS),
        default="tcp",
        help="what the peers listen on: TCP (p2pd multiplexes each connection with yamux) or QUIC over UDP",
    )
    parser.add_argument("--ways", nargs="+", choices=list(WAYS), default=list(WAYS), help="ways of emulating to run")
    parser.add_argument(
        "--shadow_modes",
        nargs="+",
        choices=list(shadow_runs(1)),
        default=None,
        help="the shadow way's runs (all but lowcomm_state_every_2)",
    )
    parser.add_argument(
        "--shadow_topk_fraction",
        type=float,
        default=None,
        help="--topk_fraction of the shadow way's lowcomm_topk run, in (0, 1] (the trainer's default)",
    )
    parser.add_argument(
        "--shadow_seconds", type=float, default=None, help="measured window of each shadow run (60; quick 30)"
    )
    parser.add_argument(
        "--loss_local_steps",
        type=int,
        default=None,
        help=f"H of the loss way's low-communication run, 1 to {MAX_BENCH_LOCAL_STEPS} (50; quick 5); the run keeps "
        "its samples, in as many more rounds",
    )
    parser.add_argument(
        "--loss_variant",
        default=None,
        metavar="H:COMPRESSION[:FRACTION]",
        help="the loss way's low-communication run, as --lowcomm_variants writes one (50:8bit; 25:topk:0.01); "
        "instead of --loss_local_steps",
    )
    parser.add_argument(
        "--lowcomm_variants",
        nargs="+",
        default=None,
        metavar="H:COMPRESSION[:FRACTION]",
        help="the rate-scaled way's low-communication runs, H and pseudo-gradient compression each, top-k's "
        f"fraction after a third colon (50:8bit 50:topk 50:topk:0.01; quick 5:8bit); compression one of "
        f"{', '.join(CODEC_KINDS)}",
    )
    args = parser.parse_args(argv)
    plan = dataclasses.replace(QUICK if args.quick else FULL, transport=args.transport)
    if args.lowcomm_variants:
        try:
            variants = [parse_variant(text) for text in args.lowcomm_variants]
        except ValueError as error:
            parser.error(f"--lowcomm_variants: {error}")
        plan = dataclasses.replace(plan, lowcomm_variants=dict(variants))
    if args.loss_local_steps is not None and not 1 <= args.loss_local_steps <= MAX_BENCH_LOCAL_STEPS:
        parser.error(f"--loss_local_steps: must be 1 to {MAX_BENCH_LOCAL_STEPS} (got {args.loss_local_steps})")
    if args.loss_local_steps is not None:
        plan = dataclasses.replace(plan, loss_variant=tuple(lowcomm_flags(args.loss_local_steps, "8bit")))
    if args.loss_variant is not None:
        if args.loss_local_steps is not None:
            parser.error("--loss_variant: give it or --loss_local_steps, not both")
        try:
            plan = dataclasses.replace(plan, loss_variant=tuple(parse_variant(args.loss_variant)[1]))
        except ValueError as error:
            parser.error(f"--loss_variant: {error}")
    if args.shadow_modes:
        plan = dataclasses.replace(plan, shadow_modes=tuple(args.shadow_modes))
    if args.shadow_topk_fraction is not None:
        try:
            make_codec("topk", topk_fraction=args.shadow_topk_fraction)
        except ValueError as error:
            parser.error(f"--shadow_topk_fraction: {error}")
        plan = dataclasses.replace(plan, shadow_topk_fraction=args.shadow_topk_fraction)
    if args.shadow_seconds is not None:
        if not 10 <= args.shadow_seconds <= 3600:
            parser.error(f"--shadow_seconds: must be 10 to 3600 seconds (got {args.shadow_seconds:g})")
        plan = dataclasses.replace(plan, shadow_seconds=args.shadow_seconds)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-ups: children, network namespaces
    wan = measure(plan, args.log_dir, ways=args.ways)
    if args.output:
        args.output.write_text(json.dumps(wan, default=str, indent=1) + "\n")
    print(json.dumps(rounded(summarize(wan))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
