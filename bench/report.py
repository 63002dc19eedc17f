"""docs/BENCHMARKS.md from one run's figures: method, command, tables, and what each figure means."""

from __future__ import annotations


def _f(value, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_f(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


PLAIN_AROUND = "plain pairs before / after"


def _slashed(values: list[float]) -> str:
    return " / ".join(_f(value, 1) for value in values)


def _plain_around(run: dict) -> str:
    return _slashed(run.get("plain_around", []))


def efficiency_section(training: dict) -> str:
    plain = training["plain_samples_per_second"]
    runs = [(run["target_batch_size"], run) for run in training["sweep"]]
    runs.append((f"{training['default_target']} (seed anchor)", training["anchor"]))
    rows = [
        [name, run["samples_per_second"], _plain_around(run), run["efficiency"], run["window_s"], _rounds(run)]
        for name, run in runs
    ]
    parity = training["parity"]
    return "\n\n".join(
        [
            f"{len(plain)} pairs of plain loops ran, one before the first collaborative run and one after each: "
            f"{min(plain):.1f} to {max(plain):.1f} samples/s. Each collaborative run is divided by the mean of the "
            "two plain pairs around it.",
            table(
                [
                    "target_batch_size",
                    "2 peers, samples/s",
                    PLAIN_AROUND,
                    "efficiency",
                    "window (s)",
                    "averaging rounds (A/B)",
                ],
                rows,
            ),
            f"Parity after {parity['steps']} global steps: held-out loss of the peers "
            f"{', '.join(_f(x, 4) for x in parity['collab_losses'])}, one process {_f(parity['reference_loss'], 4)}, "
            f"ratio **{_f(parity['ratio'], 4)}**.",
        ]
    )


def variants_section(training: dict) -> str:
    default = next(run for run in training["sweep"] if run["target_batch_size"] == training["default_target"])
    runs = [("defaults", default)] + [(run["setting"], run) for run in training["variants"]]
    rows = [
        [name, run["samples_per_second"], _plain_around(run), run["efficiency"], _rounds(run)] for name, run in runs
    ]
    return "\n\n".join(
        [
            "Each setting changed alone from the defaults (target_batch_size "
            f"{training['default_target']}), each divided by the plain pairs just before and after it.",
            table(["setting", "2 peers, samples/s", PLAIN_AROUND, "efficiency", "averaging rounds (A/B)"], rows),
        ]
    )


def _collab_runs(training: dict) -> list[tuple[str, dict]]:
    """Every collaborative run of the training figures, named as the report's rows name them."""
    runs = [(f"target_batch_size {run['target_batch_size']}", run) for run in training["sweep"]]
    runs += [("seed anchor", training["anchor"])]
    return runs + [(run["setting"], run) for run in training["variants"]]


def time_section(training: dict) -> str:
    """Each run's efficiency split into the micro-step's speed and the epoch boundaries' cost."""
    rows = []
    for name, run in _collab_runs(training):
        split = run.get("time_split")
        if not split or "plain_step_s" not in split:
            continue
        step_share = split["plain_step_s"] / split["step_s"]
        epoch_share = 1 - split["extra_s_per_epoch"] / split["epoch_s"]
        rows.append(
            [
                name,
                _f(split["step_s"], 3),
                _f(split["plain_step_s"], 3),
                step_share,
                split["extra_s_per_epoch"],
                split["epoch_s"],
                epoch_share,
                step_share * epoch_share,
                run["efficiency"],
            ]
        )
    if not rows:
        return "Not measured in this run."
    return "\n\n".join(
        [
            "Each peer's steps inside the steady window (`bench.formulas.time_split`): the median gap between two "
            "steps is its micro-step as it runs between averaging rounds; what the gaps add beyond that median, per "
            "global epoch, is what each epoch boundary costs (the gradient round, the background Lamb step and the "
            "parameter round taking CPU from the loop, and any wait for them). The plain loops' micro-step is the "
            "same batch at the plain pairs' mean rate. Efficiency is then (plain step / peer's step) x (1 - extra / "
            "epoch): the first factor is what the collaboration's background costs every step, the second what the "
            "epoch boundaries cost.",
            table(
                [
                    "run",
                    "peer's step (s)",
                    "plain step (s)",
                    "step factor",
                    "extra per epoch (s)",
                    "epoch (s)",
                    "epoch factor",
                    "product",
                    "efficiency",
                ],
                rows,
            ),
        ]
    )


def cpu_section(training: dict) -> str:
    """Cores each kind of work used while the pairs ran: where the collaboration's missing throughput went."""
    from bench.cpu import KINDS

    plain = [cpu for cpu in training.get("plain_cpu", []) if cpu]
    mean = {kind: sum(cpu[kind] for cpu in plain) / len(plain) for kind in KINDS} if plain else None
    runs = [(f"plain loops (mean of {len(plain)} pairs)", mean)]
    runs += [(f"2 peers, {name}", run.get("cpu")) for name, run in _collab_runs(training)]
    rows = [[name, *(cpu[kind] for kind in KINDS), sum(cpu.values())] for name, cpu in runs if cpu]
    if not rows:
        return "Not measured in this run."
    return "\n\n".join(
        [
            "CPU cores in use during each pair's steady window, summed over both processes and their children "
            "(`bench/cpu.py` samples every thread's CPU time in `/proc` once a second). *training loop* is each "
            "trainer's main thread (forward, backward, clipping, `hivemind.Optimizer.step`); *trainer's other "
            "threads* hold the delayed Lamb step, the progress tracker and hivemind's event loop; *hivemind "
            "processes* are the DHT and the gradient and state averagers; *p2pd* is libp2p's daemon.",
            table(["run", *KINDS, "total"], rows),
        ]
    )


def _rounds(run: dict) -> str:
    return "/".join(map(str, run["averaging_rounds"]))


def gpu_section(gpu: dict | None) -> str:
    if not gpu:
        return "Not measured: PyTorch saw no CUDA device in this run. On a GPU machine `make bench` measures it."
    return "\n\n".join(
        [
            f"Device: **{gpu['device']}**; target_batch_size {gpu['target_batch_size']}.",
            table(
                ["side (on one GPU)", "samples/s per peer or loop", "efficiency", "steady window (s)", "rounds"],
                [
                    ["plain HF AMP loops (before / after)", _slashed(gpu["plain_per_loop"]), "", "", ""],
                    [
                        "collaborating peers (fp16)",
                        gpu["per_peer_samples_per_second"],
                        gpu["efficiency"],
                        gpu["window_s"],
                        _rounds(gpu),
                    ],
                ],
            ),
        ]
    )


def link_section(link: dict) -> str:
    if "skipped" in link:
        return f"Not measured: {link['skipped']}."
    rows = [
        [
            row["params"],
            row["allreduce_s"],
            row["allreduce_bound_s"],
            row["allreduce_vs_bound"],
            row["join_s"],
            row["join_bytes"],
            row["join_bound_s"],
            row["join_vs_bound"],
        ]
        for row in link["rows"]
    ]
    goodput = link.get("goodput_mbit")
    eight_bit = link["eight_bit"]
    return "\n\n".join(
        [
            table(
                [
                    "parameters",
                    "all-reduce (s)",
                    "bound (s)",
                    "ratio",
                    "join (s)",
                    "join bytes",
                    "join bound (s)",
                    "ratio",
                ],
                rows,
            ),
            f"With `--grad_compression 8bit` (tensors of 65,536+ values as 8-bit uniform quantization) the "
            f"{eight_bit['params']:,}-parameter round takes {_f(eight_bit['allreduce_s'])} s: "
            f"{_f(eight_bit['allreduce_vs_fp16_bound'])} of the fp16 bound above, "
            f"{_f(eight_bit['speedup_over_fp16'])}x faster than fp16.",
            f"Raw TCP over the same link, both directions at once: {_f(goodput, 1)} Mbit/s each way "
            "(the link is not the bottleneck when this is close to the shaped rate).",
        ]
    )


def scaling_section(scaling: dict) -> str:
    measured = table(
        ["peers", "all-reduce round (s)", "monitor refresh (ms)"],
        [[r["peers"], r["allreduce_s"], r["monitor_refresh_ms"]] for r in scaling["measured"]],
    )
    paper = table(
        ["peers", "all-reduce bound at 100 Mbit/s (s)", "monitor aggregation (ms, linear)"],
        [[r["peers"], r["allreduce_bound_s"], r["aggregate_ms"]] for r in scaling["paper"]],
    )
    return f"Measured on this machine (tiny model, loopback):\n\n{measured}\n\nOn paper:\n\n{paper}"


METHOD = """\
Every figure is a ratio of two sides measured back to back in the same run on the same machine, so a busy machine
slows both sides alike; none of them is a pass/fail test. Processes that stand for peers are real `run_trainer.py`
processes (or, for the network figures, processes running hivemind's averagers directly), one per peer, each
limited to one thread with `OMP_NUM_THREADS=1` (checked: `torch.get_num_threads()` reports 1).

- **collab_efficiency**: two peers (`run_trainer.py` under `bench.probe`, which timestamps every
  `hivemind.Optimizer.step`) train the default model together on 127.0.0.1; their samples/s are counted over the
  window in which both train in steady state (from one global epoch after the second peer joined to the first peer's
  last step) and summed. The denominator is two plain PyTorch + Lamb loops (`bench.plain`, same model, same
  micro-batch of 16, Lamb step after every micro-batch, one thread each) run side by side: one such pair runs before
  the first collaborative run and one after each, and each collaborative run is divided by the mean of the two pairs
  around it, so a shared machine's drift moves both sides of each ratio alike. 1.0 means collaborating costs nothing
  in throughput.
- **anchor_efficiency**: the same, with the seed's `hivemind.Optimizer` settings spelled out on the command line
  (offload, delayed optimizer step and gradient averaging, fp16, parameters averaged every epoch, matchmaking 3 s),
  so the anchor stays the seed's when our defaults move.
- **allreduce_vs_bound**: two peers in two network namespaces (`bench_a`, `bench_b`) joined by a veth pair shaped
  with `tc tbf rate 100mbit` on both ends; a `hivemind.DecentralizedAverager` per peer with fp16 compression holds
  tensors shaped like a BERT encoder of about 1M, 10M and 50M parameters. Each round is started by hand once the
  group is formed (`require_trigger`), so matchmaking is not counted; a round lasts from the last peer's trigger to
  the last peer's finish (median of the rounds after one warm-up). Bound: 2·(N−1)/N · 2P bytes / bandwidth. The
  summary reports the largest model.
- **allreduce_8bit_vs_bound**: the largest model's rounds again with `--grad_compression 8bit` (tensors of 65,536
  values or more as hivemind's `Uniform8BitQuantization`, the rest fp16), divided by the same fp16 bound: below 1.0
  means 8-bit beats what fp16 could reach on this link.
- **join_vs_bound**: on the same link, a newcomer's `TrainingStateAverager.load_state_from_peers` (parameters and
  Lamb's two moments, fp16) from the other peer, divided by its bytes (2 bytes × values) / bandwidth.
- **aggregate_ms_10k**: `monitor.aggregate.aggregate` over 10,000 valid records (median of 5); beside it, the time
  for a second DHT node to read 1,000 signed `LocalMetrics` records with `collab.schema.read_metrics`.
- **parity_loss_ratio**: held-out loss (`trainer.evaluate.language_model_loss`, seeded masking) of the two peers'
  saved models after K global steps at the default target_batch_size, divided by that of one process that trains
  the same model with the same effective batch (accumulated micro-batches, each clipped as the trainer does), Lamb
  and schedule for K steps (`bench.plain reference`, two threads).
- **scaling**: rounds of the default model's size with 2, 4 and 8 averagers on 127.0.0.1, and one monitor refresh
  (read the metrics key from the DHT, then aggregate) while they are all up; then the bandwidth bound and a linear
  aggregation cost carried on paper to 64 and 256 peers.
- **gpu** (item 7, wherever PyTorch sees a CUDA device; `python -m bench --only gpu` runs it alone): two plain
  Hugging Face loops side by side on the first GPU (`bench.plain throughput --device cuda --fp16`: fp16 autocast,
  loss scaling, Lamb after every micro-batch), then two collaborating peers on that GPU (the trainer's default fp16
  path), then the plain loops again. Per-peer samples/s is the peers' total over two; efficiency divides it by the
  mean of the plain pairs around it. target_batch_size is the power of two (at least 1024) that the plain pair needs
  about 9 s to reach, as an epoch of the CPU default lasts: a GPU would finish 1024 samples in a fraction of
  matchmaking_time.
"""


def render(header: dict, figures: dict, summary: str) -> str:
    """The whole report as Markdown."""
    parts = [
        "# Benchmarks: how close collaborative training gets to the physical limit",
        f"Run of {header['date']}: `{header['command']}` took {header['wall_min']:.1f} min on {header['machine']}. "
        "Absolute samples/s and seconds depend on the machine and its load; the ratios compare sides measured back "
        "to back.",
        "## Summary (the last line `make bench` prints)",
        f"```json\n{summary}\n```",
        "## Method",
        METHOD,
    ]
    if "training" in figures:
        parts += [
            "## 1 and 5. Throughput against plain loops, and loss parity",
            efficiency_section(figures["training"]),
        ]
    if "link" in figures:
        link = figures["link"]
        parts += [
            f"## 2 and 3. All-reduce and state download on a {link.get('bandwidth_mbit', 100):g} Mbit/s link",
            "No delay was added: this kernel has no `sch_netem`, so `tc ... netem delay 20ms` is refused and "
            "the link is shaped for bandwidth only; the bounds are bytes / bandwidth.",
            link_section(link),
        ]
    if figures.get("training", {}).get("variants"):
        parts += ["## Settings tried", variants_section(figures["training"])]
    if "training" in figures:
        parts += ["## Where the time went", time_section(figures["training"])]
        parts += ["## Where the CPU went", cpu_section(figures["training"])]
    if "records" in figures:
        records = figures["records"]
        dht = records.get("dht_1000", {})
        parts += [
            "## 4. Monitor aggregation",
            table(
                ["measurement", "ms"],
                [
                    ["aggregate() over 10,000 records", records["aggregate_ms_10k"]],
                    [f"read {dht.get('read')} of {dht.get('stored')} signed records from the DHT", dht.get("read_ms")],
                ],
            ),
        ]
    if "scaling" in figures:
        parts += ["## 6. Scaling", scaling_section(figures["scaling"])]
    parts += ["## 7. GPU", gpu_section(figures.get("gpu"))]
    parts += ["## Findings and what was tried", NOTES]
    return "\n\n".join(parts) + "\n"


NOTES = """\
What the figures say, and what was tried (`make bench` of 2026-11-25 on an AMD EPYC host, 2 cores; its nine
plain-loop pairs gave 120.7 to 124.5 samples/s, so a throughput ratio here carries about +/-0.03):

- **collab_efficiency 0.961 at the defaults (target_batch_size 1024, average_state_every 2), anchor 0.950, 0.99 at
  2048.** The anchor is now a different configuration: it spells out the seed's settings, and those differ from our
  defaults only in averaging parameters every epoch. Before the default moved to 2, the two measured one configuration
  twice (0.949 and 0.934 in the previous full run; 0.957 and 0.964 alone). The change was measured before it was made,
  in three alternating pairs of `python -m bench.training --seconds 60` runs (defaults, then `--average_state_every
  2`, three times, one session): 0.942 / 0.948, 0.948 / 0.959, 0.954 / 0.969. Every pair favoured 2 (by 0.006, 0.011
  and 0.015), and the background fell from 0.053-0.063 to 0.042-0.049 cores (hivemind processes and p2pd of both
  peers). The reliability suite (`tests/integration/test_collaboration.py` and `test_partition.py`) passes with it,
  but it also passes with parameter rounds off (`--average_state_every 1000`): its peers never drift (a rolled-back
  peer downloads the state). So a new test drifts one peer's LayerNorm weight by 0.1 and checks that the next
  parameter rounds bring the two peers back (`test_parameter_rounds.py`): at 2 they end identical, three runs out of
  three; with parameter rounds off they end 0.117 apart and the test fails.
- **Why 2 and not more.** Every peer applies the same averaged gradients, so parameters only drift apart when a peer
  misses a gradient round, and the next parameter round brings it back; at 2 that is within two epochs. A parameter
  round moves as many bytes as a gradient round, so 2 sends a quarter less per epoch than 1, and 4 three eighths less.
  average_state_every 4 measured 0.98 in this run (0.96 in the previous one), within this run's noise of the default,
  while a peer that drifted would stay apart up to four epochs; operators on slow links can raise it, and peers that
  often drop rounds are better at 1.
- **Where the last 4 % goes** (section "Where the time went"): at 1024 a peer's micro-step takes 0.267 s between epoch
  boundaries against the plain loops' 0.261 (step factor 0.98), and each 8.8 s epoch adds 0.16 s at its boundary
  (epoch factor 0.98). Nothing waits: the peer's loop never blocks on hivemind (py-spy over a whole peer, idle threads
  included: its main thread was never idle, in forward or backward in 97 % of the samples and in hivemind's code in
  0.4 %; `hivemind.Optimizer.step` takes 0.55 ms against the plain loop's Lamb step of 4.4 ms, timed on one core).
  Both factors are CPU shared with the work that collaborating needs, on a machine where the two training loops
  already take both cores: hivemind's DHT process, two averager processes and p2pd (per-thread `/proc` sampling at
  average_state_every 1: DHT 0.009, p2pd 0.008, each averager 0.005 cores per peer). That is averaging work (matching
  groups ahead of the epoch's end, the rounds, the DHT traffic they make), not idle polling: with a target_batch_size
  no pair reaches, the same processes take 0.005 cores per peer, and fewer parameter rounds take less of it. At each
  boundary, the step after the one that ends the epoch is the slow one (0.37-0.45 s against 0.27 at
  average_state_every 1, without a profiler), while both peers' rounds run beside the loops. On a GPU peer, or any
  machine with a core to spare, that work runs beside the loop instead of inside its time slice. Profile with py-spy's
  `--nonblocking`: in its default blocking mode at 50 Hz over a whole process tree it stretched that peer's steps to
  0.33-0.59 s.
- **Tried against the background** (each with `python -m bench.training --seconds 60`): quieter progress tracking
  (`--progress_report_period 5 --expected_drift_peers 1 --min_refresh_period 1`) left the background where it was
  (hivemind processes 0.038 and p2pd 0.014 cores, against 0.037-0.039 and 0.015-0.017 at the defaults of then) and
  gave 0.96, so the defaults stay: progress reads and reports are not what those processes spend their time on.
- **Subnormal floats**: CPU peers and the plain loops compute subnormals as zeros (`trainer.loop.flush_denormals`).
  On the host where it was found, the default model's micro-batch took 0.36 to 0.50 s instead of 0.22 after about 30
  Lamb steps, and 0.22-0.23 with the flag. On this host the flag changes nothing measurable (0.263-0.268 s a
  micro-batch of 16 either way), so it costs nothing where it is not needed.
- **target_batch_size 256 is still a regime to avoid (0.76 in this run: 0.63 s added to each 2.9 s epoch; 0.39-0.74
  in earlier runs at average_state_every 1).** Two peers compute 256 samples in about 1.9 s, and an epoch cannot end
  before the previous epoch's background update (averaged gradients, Lamb step, averaged parameters when it is a
  parameter epoch) has finished. hivemind matches gradient rounds ahead of the epoch's end, but never parameter
  rounds: `Optimizer._maybe_schedule_state_averaging` waits for an estimate that only a pre-scheduled round updates
  (no "Pre-scheduling state averaging" line in any log), so each parameter round starts matching when its epoch ends
  and needs matchmaking_time (3 s) before its group forms, and the epoch after it stretches to about that. With a
  parameter round every second epoch, only every second epoch stretches, which is why 256 went from 0.39-0.74 to
  0.76. Shorter still, an averager is still matching one round when the next is due ("Another look_for_group is
  already in progress"), rounds pair up across epochs, and each part that never comes costs next_chunk_timeout
  ("Reducer: received 50.0% of input tensors"): that was the 0.39-0.43 mode. Tried: pre-scheduling parameter rounds
  (seeding that estimate): 58.6 samples/s against 90.6 without, two 30 s runs back to back, with a partial round
  every epoch, so not kept; `python -m bench.training --target_batch_size 256 --matchmaking_time 1`: 0.86, against
  0.41 for `--target_batch_size 256` alone (both at average_state_every 1), each between its own plain pairs in one
  session. Peers warn when their epochs last less than twice matchmaking_time and name both flags.
- **Other settings tried at 1024** (each alone, each between its own plain pairs): average_state_every 4: 0.98;
  matchmaking_time 1 s: 0.98; no delayed step or gradient averaging: 0.97; 8-bit gradients: 0.98. In the previous
  two runs (at average_state_every 1): 0.96 / 0.96 / 0.97 / 0.96 and 0.96 / 0.94 / 0.92 / 0.90. Their step and
  epoch factors move with the host as much as with the setting, so none is a clear gain over the defaults, and none
  became one: 1 s of matchmaking is too short across the internet (10-15 s online), and 8-bit gradients cost
  precision that fp16 keeps. `python -m bench.training FLAGS` measures one setting the same way in about 3 minutes.
- **Fixed in earlier runs, all in `collab/hivemind_fixes.py`**: the state-download declaration re-stored after every
  averaged part (300+ DHT stores per averager in two minutes, now 9), progress published after every step (now at
  most once per `--progress_report_period` of 2 s, and a new epoch at once), matchmaking that polled the DHT back to
  back (about 110 leader lookups per round, now at most ten). Together with a cheaper NaN guard they took the
  background of a default pair from 0.41 to 0.06 cores. The efficiency denominators: a plain pair runs before the
  first collaborative run and after each one, and each run is divided by the two pairs around it.
- **Parity 1.0001** (peers 7.0616, one process 7.0609 after 8 global steps at average_state_every 2; 1.0004 and 0.9999
  in the previous runs at 1). It was 1.018-1.019 until hivemind's optimizer initialization was bypassed:
  `TrainingStateAverager` runs one Lamb step on zero gradients to create the state tensors, and for Lamb that step
  shrinks every decayed weight by its step size (6.3 % at the default learning rate) and counts a step in the bias
  correction. Lamb's state is now created up front (`collab/optim.py create_lamb_state`, tests in
  `tests/unit/test_optim.py`).
- **allreduce_vs_bound 1.16 and join_vs_bound 1.24** (50M parameters; 1.15 and 1.24 at 10M): raw TCP over the
  shaped link reaches 92 Mbit/s in both directions at once (0.92 of the shaped rate, so about 1.09 of the bound is
  the link itself); the rest is hivemind's own cost (fp16 conversion, protobuf and asyncio in the averager process).
  For the 1M model, fixed costs (group setup, one request and response per part) dominate. 8-bit gradients make
  the 50M round 0.58 of the fp16 bound. A 20 ms delay needs `sch_netem`, absent from this kernel.
- **aggregate_ms_10k 27**: one compiled pydantic v2 validation per record, plus the filter that drops peers more
  than `--alive_step_lag` epochs behind. Reading 1,000 signed records from the DHT takes about 0.14 s: each
  record's RSA signature and schema are checked on arrival.
- **Scaling**: rounds of the default model on loopback grow from 0.14 s (2 peers) to 0.46 s (8), all on two cores;
  the bandwidth bound stays under 0.5 s to 256 peers, and aggregation stays under 1 ms per refresh.
- **GPU (item 7) is built but not measured**: no GPU was lent to the sessions that ran this benchmark. `make bench`
  on any CUDA machine adds section 7 and a `gpu` key to the summary (`python -m bench --only gpu`, a few minutes,
  measures it alone). What CI checks of that path without a GPU: the trainer's fp16 loop (autocast, loss scaling,
  unscale before clipping, hivemind.Optimizer) runs on CPU in `tests/unit/test_mixed_precision.py` and takes the
  same steps as fp32 on the same micro-batches (update cosine 1.00001, loss within 1 %), and the plain AMP loop runs
  in `tests/unit/test_bench.py`.
"""
