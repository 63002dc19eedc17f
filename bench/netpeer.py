"""One peer of the averaging benchmarks: ``python -m bench.netpeer --rank R --peers N --sync_dir D ...``.

Rank 0 starts the DHT and writes its address to D; the others join through it. For each model size the peers
run timed all-reduce rounds, fp16 or ``--compression 8bit`` (group of all N peers, all-reduce started by hand once
the group is formed, so matchmaking is not counted); with ``--join_state`` rank 1 then downloads rank 0's parameters
and Lamb state.
Results go to ``D/rank{R}.json``; the peers meet at file barriers in D between phases.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import hivemind
import torch
from hivemind.averaging.control import AveragingStage
from hivemind.compression import Float16Compression
from hivemind.utils import get_dht_time

from arguments import TrainingArguments
from collab.averagers import FiniteAverager, FiniteTrainingStateAverager
from collab.hivemind_fixes import FixedDHT, apply_entry_point_patches
from collab.optim import gradient_compression, lamb_factory
from collab.schema import LocalMetrics, make_validators, metrics_key
from collab.timeouts import derive_timeouts, estimate_transfers
from trainer.local import wait_until

VOCAB = 4096
PHASE_TIMEOUT = 300.0
FP16 = 2  # bytes per value on the wire
ROUND_TRIES = 3  # tries of each timed round, all peers together

logger = logging.getLogger(__name__)


def model_like_shapes(params: int) -> list[tuple[int, ...]]:
    """Tensor shapes of a BERT-like encoder with about ``params`` parameters (vocabulary 4096)."""
    hidden = 128 if params < 3_000_000 else 384 if params < 20_000_000 else 768
    per_layer = [(hidden, hidden)] * 4 + [(hidden, 4 * hidden), (4 * hidden, hidden)] + [(hidden,)] * 9
    per_layer += [(4 * hidden,)]
    layer_numel = sum(torch.Size(shape).numel() for shape in per_layer)
    layers = max(1, round((params - VOCAB * hidden) / layer_numel))
    return [(VOCAB, hidden), (512, hidden)] + per_layer * layers


def barrier(sync_dir: Path, phase: str, rank: int, peers: int) -> None:
    agree(sync_dir, phase, rank, peers, succeeded=True)


def start_dht(args, sync_dir: Path) -> hivemind.DHT:
    validators, _ = make_validators(args.metrics_prefix)
    address = sync_dir / "maddrs.json"
    initial = []
    if args.rank > 0:
        wait_until(address.exists, PHASE_TIMEOUT, "the first peer's address", poll=0.2)
        initial = json.loads(address.read_text())
    dht = FixedDHT(
        start=True, initial_peers=initial, host_maddrs=[f"/ip4/{args.host}/tcp/0"], record_validators=validators
    )
    if args.rank == 0:
        tmp = sync_dir / "maddrs.tmp"
        tmp.write_text(json.dumps([str(m) for m in dht.get_visible_maddrs()]))
        tmp.rename(address)
    return dht


def publish_metrics(dht: hivemind.DHT, prefix: str, rank: int) -> None:
    """A real LocalMetrics record, signed by this process's key, as a trainer publishes it."""
    _, public_key = make_validators(prefix)
    metrics = LocalMetrics(step=1, samples_per_second=10.0 + rank, samples_accumulated=64, loss=7.5, mini_steps=4)
    dht.store(metrics_key(prefix), metrics.model_dump(), get_dht_time() + 600, subkey=public_key)


def timed_rounds(dht, tensors, prefix: str, args, sync_dir: Path) -> list[tuple[float, float]]:
    """``rounds`` all-reduce rounds after one warm-up; each ``(time the all-reduce was let go, time it ended)``.

    A round that fails on any peer is run again by all of them (``ROUND_TRIES``): under load hivemind's matchmaking
    can count a follower whose join request timed out, and the group then waits for it until its all-reduce times
    out (``round_timeout``)."""
    timeout = round_timeout(sum(t.numel() for t in tensors), args)
    averager = FiniteAverager(
        averaged_tensors=tensors,
        dht=dht,
        prefix=prefix,
        start=True,
        compression=gradient_compression(args.compression),
        target_group_size=args.peers,
        min_group_size=args.peers,
        min_matchmaking_time=args.matchmaking_time,
        allreduce_timeout=timeout,
        bandwidth=args.bandwidth,
    )
    times = []
    try:
        for index in range(args.rounds + 1):
            span = agreed_round(averager, sync_dir, f"{prefix}_round{index}", args, timeout)
            if index > 0:
                times.append(span)
    finally:
        averager.shutdown()
    return times


def round_timeout(numel: int, args) -> float:
    """The trainers' averaging timeout for a round of ``numel`` values among ``--peers`` at ``--bandwidth``."""
    transfers = estimate_transfers(
        parameters=numel,
        round_values_per_parameter=1,
        state_values_per_parameter=0,
        bytes_per_value=1 if args.compression == "8bit" else FP16,
        model_bytes=0,
        group_size=args.peers,
        bandwidth_mbit=args.bandwidth,
    )
    return derive_timeouts(transfers, args.matchmaking_time).averaging_timeout


def agreed_round(averager, sync_dir: Path, phase: str, args, timeout: float) -> tuple[float, float]:
    """One round every peer completed in a group of all ``--peers``; tries again, all peers together, otherwise."""
    for attempt in range(ROUND_TRIES):
        span = one_round(averager, args.peers, timeout)
        if agree(sync_dir, f"{phase}_try{attempt}", args.rank, args.peers, span is not None):
            return span
        logger.warning(f"{phase}: a peer's round failed (try {attempt + 1} of {ROUND_TRIES}); all peers try again")
    raise RuntimeError(f"{phase}: no round that every peer completed in {ROUND_TRIES} tries")


def one_round(averager, peers: int, timeout: float) -> tuple[float, float] | None:
    """``(time the all-reduce was let go, time it ended)``, or None where the round failed or its group was short."""
    control = averager.step(wait=False, require_trigger=True, allow_retries=False, timeout=timeout)
    wait_until(
        lambda: control.stage == AveragingStage.AWAITING_TRIGGER or control.done(),
        PHASE_TIMEOUT,
        "an averaging group",
        poll=0.005,
    )
    started = time.time()
    control.allow_allreduce()
    try:
        group = control.result(timeout=timeout + PHASE_TIMEOUT)
    except Exception as error:  # hivemind's matchmaking and all-reduce errors, a timeout: this try failed
        logger.warning(f"round failed: {error!r}")
        return None
    if not group or len(group) != peers:
        logger.warning(f"round formed a group of {len(group or ())} peers, expected {peers}")
        return None
    return started, time.time()


def agree(sync_dir: Path, phase: str, rank: int, peers: int, succeeded: bool) -> bool:
    """A file barrier that also tells every peer whether all of them ``succeeded``."""
    tmp = sync_dir / f"{phase}.tmp{rank}"
    tmp.write_text("1" if succeeded else "0")
    tmp.rename(sync_dir / f"{phase}.{rank}")
    paths = [sync_dir / f"{phase}.{other}" for other in range(peers)]
    wait_until(lambda: all(path.exists() for path in paths), PHASE_TIMEOUT, f"barrier {phase}", poll=0.1)
    return all(path.read_text() == "1" for path in paths)


def state_numel(optimizer: torch.optim.Optimizer, params) -> int:
    """Values a newcomer downloads: the parameters and every tensor of the optimizer's per-parameter state."""
    state = [value for per_param in optimizer.state_dict()["state"].values() for value in per_param.values()]
    return sum(p.numel() for p in params) + sum(t.numel() for t in state if torch.is_tensor(t) and t.numel() > 1)


def state_transfer(dht, shapes, prefix: str, args, sync_dir: Path) -> dict | None:
    """Rank 1 downloads rank 0's parameters and Lamb state (fp16); returns seconds and bytes for rank 1."""
    torch.manual_seed(args.rank)  # different values on each peer: a download is seen as a change
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    averager = FiniteTrainingStateAverager(
        dht=dht,
        optimizer=lamb_factory(TrainingArguments()),
        params=params,
        prefix=prefix,
        start=True,
        state_compression=Float16Compression(),
        allow_state_sharing=args.rank == 0,
        declare_state_period=5,
        target_group_size=args.peers,
    )
    result = None
    try:
        barrier(sync_dir, f"{prefix}_up", args.rank, args.peers)
        if args.rank == 1:
            time.sleep(1.0)  # let the donor's declaration reach the DHT
            deadline = time.monotonic() + PHASE_TIMEOUT
            while result is None and time.monotonic() < deadline:
                before = params[0].detach().clone()
                started = time.monotonic()
                averager.load_state_from_peers(timeout=PHASE_TIMEOUT)
                seconds = time.monotonic() - started
                if not torch.equal(before, params[0]):
                    result = {"seconds": seconds, "bytes": FP16 * state_numel(averager.optimizer, params)}
        barrier(sync_dir, f"{prefix}_done", args.rank, args.peers)
    finally:
        averager.shutdown()
    return result


def main(argv=None) -> None:
    apply_entry_point_patches()  # the trainer's entry point applies the same
    parser = argparse.ArgumentParser(prog="python -m bench.netpeer")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--sync_dir", required=True)
    parser.add_argument("--sizes", type=int, nargs="+", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--matchmaking_time", type=float, default=2.0)
    parser.add_argument("--bandwidth", type=float, default=100.0)
    parser.add_argument("--compression", choices=["fp16", "8bit"], default="fp16", help="as --grad_compression")
    parser.add_argument("--join_state", action="store_true")
    parser.add_argument("--hold", action="store_true", help="wait for D/release before leaving")
    parser.add_argument("--metrics_prefix", default="bench")
    args = parser.parse_args(argv)
    sync_dir = Path(args.sync_dir)
    out = sync_dir / f"rank{args.rank}.json"
    results: dict = {"rounds": {}, "join": {}}
    dht = start_dht(args, sync_dir)
    try:
        publish_metrics(dht, args.metrics_prefix, args.rank)
        (sync_dir / f"published.{args.rank}").touch()
        # Give each process one size: an averager built after another has shut down can lose the DHT (EOFError or
        # ConnectionResetError in multiprocessing's resource sharer), so the benchmark starts fresh processes.
        for size in args.sizes:
            shapes = model_like_shapes(size)
            if args.join_state:
                results["join"][size] = state_transfer(dht, shapes, f"bench_st{size}", args, sync_dir)
            else:
                tensors = [torch.randn(shape) for shape in shapes]
                barrier(sync_dir, f"ar{size}", args.rank, args.peers)
                results["rounds"][size] = timed_rounds(dht, tensors, f"bench_ar{size}", args, sync_dir)
                results["numel"] = {**results.get("numel", {}), size: sum(t.numel() for t in tensors)}
            out.write_text(json.dumps(results))
        barrier(sync_dir, "end", args.rank, args.peers)
        if args.hold:  # stay in the DHT until the benchmark has read every record
            wait_until((sync_dir / "release").exists, PHASE_TIMEOUT, "the benchmark's release", poll=0.2)
    finally:
        dht.shutdown()


if __name__ == "__main__":
    main()
