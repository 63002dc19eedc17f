"""A newcomer downloads a big state over a slow link: ``python -m bench.join [--mbit 40] [--layers 12]
[--local_steps H]``; the last line is one JSON object.

Two shadow peers (``bench.shadow``: GPT-2 small's shapes, 124M parameters with 12 layers, compute a calibrated wait)
in network namespaces on bench.procs' hub. The veteran trains alone behind a fast link until it has made
``VETERAN_EPOCHS`` global steps; then the newcomer starts behind a link of ``--mbit`` each way and joins it. Its
state (parameters and Lamb's two moments, in fp16 on the wire) is then several hundred MB: at 40 Mbit/s the download
outlasts many of the veteran's epochs, so the newcomer also has to catch up (``catching_up``, then ``caught_up``
with the next parameter round) before its first gradient round with its own samples. With ``--local_steps H`` both
peers run the low-communication mode, where the newcomer asks for that parameter round (``repair_requested``,
``repairs_requested`` in the figures) and its first own round is a pseudo-gradient round, which may come before it
is whole (``collab.averagers.catching_up_weight``: pseudo-gradients from a state a few rounds old count, weighted
down).

Figures, from the newcomer's events and its link's kernel counters:

- ``download_s`` and ``download_vs_bound``: the download's time over the bound (the bytes its link received while
  it downloaded, through ``--mbit``), ``tries`` (donors asked until the first state applied, by the loads that
  applied none too: 1 means no retry), ``failed_loads`` (loads before it that applied no state, its
  ``state_not_loaded`` events) and ``loads`` (loads that moved the peer to a newer state, its ``state_loaded``
  events: 1 means no reload loop);
- ``join_seconds_vs_bound``: from its ``joined`` event to its first gradient round with its own samples, over the
  bound (``bench.swarm.join_seconds_vs_bound``, the issue's figure, goal 1.5).

Memory: each 12-layer shadow peer holds about 8 GB while averaging (bench.wan's note), so the two fit in 24 GB.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.formulas import MBIT, rounded
from bench.procs import (
    ONE_THREAD,
    Child,
    NamespacesUnavailable,
    children,
    hub_network,
    read_json_lines,
    wait_for,
)
from bench.shadow import shadow_numel
from bench.swarm import JOIN_GOAL, PeerRun, join_seconds_vs_bound, own_round
from bench.wan import MAX_BENCH_LOCAL_STEPS, lowcomm_flags

FAST_MBIT = 1000.0  # the veteran's link: the newcomer's is the one measured
VETERAN_EPOCHS = 3  # global steps the veteran makes alone before the newcomer starts: a state past epoch 0
MICRO_BATCH_S = 0.2  # the shadow peers' forward and backward (bench.wan's GPT-2 small on its 60 TFLOP/s GPU)
TARGET_BATCH_SIZE = 512


def shadow_flags(prefix: str, address: str, mbit: float, layers: int, mode: Sequence[str], output: Path) -> list[str]:
    """A shadow peer's own flags: its address, the link rate its timeouts are derived from (``--bandwidth``: both
    peers give the newcomer's, as a swarm's operator sizes them for its slowest volunteers), its model's size and
    ``mode``'s flags (none: the synchronous mode)."""
    return [
        *("--experiment_prefix", prefix, "--host_maddrs", f"/ip4/{address}/tcp/0"),
        *("--bandwidth", f"{mbit:g}", "--target_batch_size", str(TARGET_BATCH_SIZE), "--output_dir", str(output)),
        *("--layers", str(layers), "--micro_batch_s", f"{MICRO_BATCH_S:g}", *mode),
    ]


def first_own_round(events: list[dict]) -> dict | None:
    return next(filter(own_round, events), None)


def loads_until_loaded(events: list[dict]) -> list[dict]:
    """The ``state_not_loaded`` events before the first ``state_loaded``, and that one (when there is one)."""
    loads = []
    for record in events:
        if record["event"] in ("state_not_loaded", "state_loaded"):
            loads.append(record)
            if record["event"] == "state_loaded":
                break
    return loads


def measure(mbit: float, layers: int, log_dir: Path, timeout: float, mode: Sequence[str] = ()) -> dict:
    """Run the veteran and the newcomer, both with ``mode``'s flags; the figures of the newcomer's join."""
    log_dir.mkdir(parents=True, exist_ok=True)
    names = ("veteran", "newcomer")
    paths = {name: (log_dir / f"{name}.steps.jsonl", log_dir / f"{name}.events.jsonl") for name in names}
    for steps, _ in paths.values():
        steps.unlink(missing_ok=True)
    deadline, prefix = time.monotonic() + timeout, f"bench_join_{int(time.time())}"
    with hub_network(2, FAST_MBIT, FAST_MBIT, prefix="join", subnet="10.81.0") as network, children() as started:
        veteran_site, newcomer_site = network.peers
        veteran = Child(
            "bench.shadow",
            [
                paths["veteran"][0],
                *shadow_flags(prefix, veteran_site.address, mbit, layers, mode, log_dir / "veteran"),
            ],
            log_dir / "veteran.log",
            timeout,
            env=ONE_THREAD,
            netns=veteran_site.netns,
            events_path=paths["veteran"][1],
        )
        started.append(veteran)
        join = veteran.join_flags(300)

        def veteran_epoch() -> int:  # shadow peers write no epoch events (no training callback): their steps do
            return max((record[2] for record in read_json_lines(paths["veteran"][0])), default=-1)

        wait_for(lambda: veteran_epoch() >= VETERAN_EPOCHS, 900, "the veteran's epochs", alive=[veteran])
        network.set_peer_rate(1, mbit, mbit)
        received_before = network.counters()[1]["rx_bytes"]
        newcomer_started = time.time()
        newcomer = Child(
            "bench.shadow",
            [
                paths["newcomer"][0],
                *shadow_flags(prefix, newcomer_site.address, mbit, layers, mode, log_dir / "newcomer"),
                *join,
            ],
            log_dir / "newcomer.log",
            max(1.0, deadline - time.monotonic()),
            env=ONE_THREAD,
            netns=newcomer_site.netns,
            events_path=paths["newcomer"][1],
        )
        started.append(newcomer)
        left = max(1.0, deadline - time.monotonic())
        loaded = newcomer.wait_for_event("state_loaded", left)
        received = network.counters()[1]["rx_bytes"] - received_before
        left = max(1.0, deadline - time.monotonic())
        wait_for(lambda: first_own_round(newcomer.events()), left, "the newcomer's first own round", alive=[newcomer])
        events = newcomer.events()
    bound_s = received / (mbit * MBIT)
    loads = loads_until_loaded(events)
    run = PeerRun("newcomer", "newcomer", newcomer_started, mbit, events=events)
    return {
        "mbit": mbit,
        "params": shadow_numel(layers),
        "state_bytes_in_memory": loaded["bytes"],
        "received_bytes": received,
        "download_s": loaded["seconds"],
        "bound_s": bound_s,
        "download_vs_bound": loaded["seconds"] / bound_s if bound_s else None,
        "tries": sum(record.get("tries") or 0 for record in loads),
        "failed_loads": sum(record["event"] == "state_not_loaded" for record in loads),
        "loads": sum(record["event"] == "state_loaded" for record in events),
        "state_epoch": loaded["epoch"],
        "caught_up_s": next((r["seconds"] for r in events if r["event"] == "caught_up"), None),
        "repairs_requested": sum(record["event"] == "repair_requested" for record in events),
        "join_seconds_vs_bound": join_seconds_vs_bound(run),
        "join_goal": JOIN_GOAL,
        "first_own_round_after_joined_s": first_own_round(events)["time"]
        - next(r["time"] for r in events if r["event"] == "joined"),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.join", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mbit", type=float, default=40.0, help="the newcomer's link, each way (Mbit/s)")
    parser.add_argument("--layers", type=int, default=12, help="GPT-2 blocks of the shadow model (12: 124M)")
    parser.add_argument("--minutes", type=float, default=30.0, help="the whole run's deadline")
    parser.add_argument(
        "--local_steps", type=int, default=0, help="H of both peers' low-communication mode (0: synchronous)"
    )
    parser.add_argument("--pseudo_grad_compression", default="8bit", choices=("fp16", "8bit", "topk"))
    parser.add_argument("--log_dir", type=Path, default=Path("outputs/bench/join"), help="every process's log")
    args = parser.parse_args(argv)
    if not (0 < args.mbit <= 10_000 and 1 <= args.layers <= 48 and 1 <= args.minutes <= 240):
        parser.error("--mbit must be in (0, 10000], --layers 1 to 48, --minutes 1 to 240")
    if not 0 <= args.local_steps <= MAX_BENCH_LOCAL_STEPS:
        parser.error(f"--local_steps: must be 0 to {MAX_BENCH_LOCAL_STEPS} (got {args.local_steps})")
    mode = lowcomm_flags(args.local_steps, args.pseudo_grad_compression) if args.local_steps else []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-ups: children, network namespaces
    try:
        figures = measure(args.mbit, args.layers, args.log_dir, args.minutes * 60, mode)
    except NamespacesUnavailable as e:
        print(f"not measured: {e}")
        print(json.dumps({"skipped": str(e)}))
        return 0
    print(
        f"state: {figures['received_bytes'] / 1e6:.0f} MB received in {figures['download_s']:.1f} s over "
        f"{args.mbit:g} Mbit/s ({figures['download_vs_bound']:.2f} x the bound), {figures['tries']} download(s), "
        f"{figures['failed_loads']} failed load(s) before it, {figures['loads']} load(s); first own round "
        f"{figures['first_own_round_after_joined_s']:.0f} s after joining: {figures['join_seconds_vs_bound']:.2f} x "
        f"the bound (goal {JOIN_GOAL})"
    )
    print(json.dumps(rounded(figures)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
