"""docs/BENCHMARKS.md from one run's figures: the command, what each figure means, and the measured tables.

Only what the figures say goes here; what a run found and what was tried goes in a dated file of docs/benchmarks/."""

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
            "Each precision and mode, two peers on the same GPU (base: BERT-base shape, about 90M parameters, "
            "from scratch; lowcomm: `--local_steps 4 --pseudo_grad_compression 8bit`; its rounds are outer rounds):",
            table(
                ["setting", "samples/s per peer", "steady window (s)", "rounds", "dropped batches"],
                [_gpu_mode_row(row) for row in gpu.get("modes", [])],
            ),
            *([_gpu_loss_line(gpu["loss"])] if gpu.get("loss") else []),
        ]
    )


def _gpu_loss_line(loss: dict) -> str:
    """The two modes' held-out losses after the same global batches (``bench.gpu.gpu_loss``)."""

    def side(mode: str) -> str:
        run = loss[mode]
        return f"failed: {run['error']}" if "error" in run else " / ".join(_f(x, 3) for x in run["held_out_loss"])

    return (
        f"Held-out loss of the two BERT-base peers (bf16) after the same {loss['global_batches']} global batches of "
        f"{loss['target_batch_size']}: synchronous **{side('sync')}**, low-communication (H={loss['local_steps']}, "
        f"8-bit) **{side('lowcomm')}**; ratio low-communication / synchronous **{_f(loss['ratio'], 3)}**."
    )


def _gpu_mode_row(row: dict) -> list:
    if "error" in row:
        return [row["setting"], f"failed: {row['error']}", "", "", ""]
    dropped = "/".join(map(str, row.get("dropped_batches", [])))  # figures saved before it was counted lack it
    return [row["setting"], row["per_peer_samples_per_second"], row["window_s"], _rounds(row), dropped]


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


def _rounds_per_peer(run: dict) -> str:
    given_up = run.get("rounds_given_up") or [None] * len(run.get("averaging_rounds", []))
    pairs = zip(run.get("averaging_rounds", []), given_up, strict=True)
    return " / ".join(f"{_f(done)} ({_f(skipped)})" for done, skipped in pairs)


def _parameter_rounds_per_peer(run: dict) -> str:
    return " / ".join(_f(count) for count in run.get("parameter_rounds") or [])


def _tcp_stalls_per_peer(run: dict) -> str:
    """Each peer's retransmission timeouts (connections reset) in the window; empty for a run measured before."""
    counts = run.get("tcp") or []
    return " / ".join(f"{c['retransmission_timeouts']} ({c['established_resets']})" for c in counts)


def _with_its_alone_run(name: str, rate: float, run: dict) -> list[list]:
    """A low-communication run's row, between the rows of the same peers alone in that mode before and after it
    (its efficiency's base: the shadow way has the one before only)."""
    alone = [[f"alone, {name}", "no link", run["alone"]]] if run.get("alone") else []
    after = [[f"alone after, {name}", "no link", run["alone_after"]]] if run.get("alone_after") else []
    return [*alone, [name, rate, run], *after]


def wan_section(wan: dict) -> str:
    """Swarms on the emulated wide-area network: each mode against the same peers alone, and its traffic."""
    if "skipped" in wan:
        return f"Not measured: {wan['skipped']}."
    scaled, shadow = wan["rate_scaled"], wan["shadow"]
    setting = wan["setting"]
    modes = [
        ["alone (rate scaling)", scaled["rate_mbit"], scaled["alone"]],
        ["synchronous (rate scaling)", scaled["rate_mbit"], scaled["sync"]],
    ]
    for name, run in scaled["lowcomm"].items():
        if run:
            modes += _with_its_alone_run(f"low-communication {name} (rate scaling)", scaled["rate_mbit"], run)
    for key, name in (("alone", "alone (shadow compute)"), ("sync", "synchronous (shadow compute)")):
        if key in shadow:  # a run of only some of the shadow modes (python -m bench.wan --shadow_modes)
            modes.append([name, shadow["rate_mbit"], shadow[key]])
    name = f"low-communication H {shadow.get('local_steps')}, 8bit (shadow compute)"
    if "lowcomm" in shadow:
        modes += _with_its_alone_run(name, shadow["rate_mbit"], shadow["lowcomm"])

    def sharing_the_8bit_alone_run(name: str, run: dict) -> list[list]:  # shown once, before the 8-bit run
        return (
            [[name, shadow["rate_mbit"], run]]
            if "lowcomm" in shadow
            else _with_its_alone_run(name, shadow["rate_mbit"], run)
        )

    if "lowcomm_topk" in shadow:
        fraction = shadow.get("topk_fraction")
        kind = f"topk {fraction:g}" if fraction else "topk"
        topk_name = f"low-communication H {shadow.get('local_steps')}, {kind} (shadow compute)"
        modes += sharing_the_8bit_alone_run(topk_name, shadow["lowcomm_topk"])
    if "lowcomm_state_every_2" in shadow:  # the same peers with parameter rounds every second round
        run = shadow["lowcomm_state_every_2"]
        modes.append([f"{name}, parameter rounds every 2nd round", shadow["rate_mbit"], run])
    if "lowcomm_long" in shadow:  # the 8-bit run at a longer H
        long_name = f"low-communication H {shadow.get('long_local_steps')}, 8bit (shadow compute)"
        modes += sharing_the_8bit_alone_run(long_name, shadow["lowcomm_long"])
    rows = [
        [
            name,
            _f(rate, 3),
            run["samples_per_second"],
            run.get("efficiency"),
            run.get("busy_fraction"),
            _f(run.get("bits_per_param_per_step"), 4),  # against goals of 0.1 and 0.01
            run["window_s"],
            _rounds_per_peer(run),
            _parameter_rounds_per_peer(run),
            _tcp_stalls_per_peer(run),
        ]
        for name, rate, run in modes
    ]
    missing = [name for name, run in scaled["lowcomm"].items() if not run]
    loss = wan.get("loss")
    lines = [
        f"Setting represented: {setting['name']}; a synchronous round lasts {_f(scaled['comm_to_compute'])}x an "
        f"epoch's compute there. *Rate scaling*: {scaled['params']:,}-parameter default model, "
        f"{_f(scaled['epoch_compute_s'])} s of compute per epoch on this machine (the alone run), so each link is "
        f"shaped to {_f(scaled['rate_mbit'], 3)} Mbit/s each way. *Shadow compute*: GPT-2-shaped gradients "
        f"({shadow['params']:,} parameters), {_f(shadow['micro_batch_s'], 3)} s per micro-batch of 16, links at "
        f"{_f(shadow['rate_mbit'], 1)} Mbit/s. No added delay or loss (this kernel has no sch_netem)."
        + _congestion_control(scaled, shadow),
        table(
            [
                "mode (way of emulating)",
                "link (Mbit/s)",
                "samples/s",
                "efficiency",
                "busy",
                "bits/param/step",
                "window (s)",
                "gradient rounds averaged (given up), per peer",
                "parameter rounds, per peer",
                "TCP retransmission timeouts (resets), per peer",
            ],
            rows,
        ),
    ]
    if missing:
        lines.append(f"Not available in this run (no `--local_steps` in run_trainer.py): {', '.join(missing)}.")
    if loss:
        lines.append(_wan_loss_line(loss))
    return "\n\n".join(lines)


def _wan_loss_line(loss: dict) -> str:
    """The loss ratio's sentence: the low-communication swarm's models, then the synchronous mode's updates over as
    many samples (the plain reference loop)."""
    sync, lowcomm = loss["sync"], loss["lowcomm"]
    return (
        f"Held-out loss at equal samples (real compute, {loss.get('common', 'default flags')}): low-communication "
        f"({loss['variant']}, on {loss.get('links', 'fast links')}) {', '.join(_f(x, 4) for x in lowcomm['losses'])} "
        f"after {sum(lowcomm['samples'])} samples in all ({lowcomm['samples']} per peer); the synchronous mode's "
        f"updates (`bench.plain reference`: one process, Lamb over global batches, the loop the parity figure "
        f"matches to a synchronous swarm) {_f(sync['loss'], 4)} after {sync['global_batches']} global batches "
        f"({sync['samples']} samples); ratio **{_f(loss['ratio'], 4)}**."
    )


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
  matchmaking_time. Then each precision and mode on the default model and a BERT-base shape, and last the held-out
  loss (`bench.training.held_out_loss`, on the GPU) of two BERT-base peers after the same global batches in each
  mode (`bench.gpu.gpu_loss`: stopped by `--max_steps`, 8 outer rounds of 4 global batches against 32 batches).
- **wan** (`python -m bench --only wan`, `bench/wan.py`): three peers (two for shadow compute, whose 124M-parameter
  peers take about 8 GB each), each in its own network namespace, joined through a bridge in a hub namespace; each
  peer's upload is shaped with tbf on its end of its veth pair and its download on the hub's end. Bytes are the
  kernel's counters of each peer's link (`ip -j -s link`), both directions, over the measured window, per parameter
  and per step (a global epoch in synchronous mode, an inner step in low-communication mode). Peers start on fast
  links (the newcomers' state download is not measured), then the links are shaped, one epoch passes and the window
  opens. The same peers, each training alone in its own experiment on the same network, are the denominator of each
  efficiency; alone, a peer averages nothing, so its window opens after its first steps. On the rate-scaled way the
  low-communication runs of one H sit between two alone runs, before and after, and the mean of the two is their
  denominator: this shared machine's speed drifts between windows minutes apart. *Busy* is the share of the
  window the peers computed (median over them, `bench.wan.busy_fraction`: each interval between two of a peer's
  steps counts up to twice its median interval, the rest is waiting), the figure OpenDiLoCo and INTELLECT-1 report
  as compute utilisation; efficiency also counts what the peers' sharing these few cores costs. *Rate scaling* runs
  real `run_trainer.py` peers on links slowed so that a synchronous round's time over an epoch's compute equals that of
  the setting named above the table; *shadow compute* (`bench/shadow.py`) runs the real optimizer path on
  GPT-2-shaped gradients with a calibrated wait for forward and backward (utilisation and traffic only, never loss).
  TCP retransmission timeouts and resets are the kernel's counters of each peer's namespace over the window
  (`bench.procs.tcp_counters`): a connection stalled on its shaped link, or torn down under a round.
  Rounds averaged and given up are the peers' `averaged` and `round_given_up` events; a window that holds none of
  the low-communication mode's rare parameter rounds reads a little fast. The loss ratio's low-communication side is
  the rate-scaled run of its variant (whole outer rounds, each peer stopping at the last one's end, `--max_steps`;
  its window runs from every peer's first round to the first peer's last); its synchronous side is the synchronous
  mode's updates over as many samples, computed by one process (`bench.plain reference`).
"""


def _congestion_control(*ways: dict) -> str:
    """What carried the peers' traffic: the TCP congestion control the ways' namespaces ran (the host's default),
    or QUIC, where the figures recorded it."""
    over_tcp = [way for way in ways if way.get("congestion_control") and way.get("transport") != "quic"]
    tcp = sorted({way["congestion_control"] for way in over_tcp})
    line = f" TCP congestion control in the namespaces: {', '.join(tcp)}." if tcp else ""
    if any(way.get("transport") == "quic" for way in ways):
        line += " Peers connected over QUIC (UDP, with quic-go's own congestion control)."
    return line


def render(header: dict, figures: dict, summary: str) -> str:
    """The whole report as Markdown."""
    # make bench runs its scenario tests first; python -m bench times only itself
    ran = (
        "`python -m bench`, the figures of `make bench` (after its scenario tests, not timed here),"
        if header["command"] == "make bench"
        else f"`{header['command']}`"
    )
    parts = [
        "# Benchmarks: how close collaborative training gets to the physical limit",
        f"Run of {header['date']}: {ran} took {header['wall_min']:.1f} min on {header['machine']}. "
        "Absolute samples/s and seconds depend on the machine and its load; the ratios compare sides measured back "
        "to back. This file holds one run's tables and is rewritten by each run; what runs found and what was tried "
        "is in `docs/benchmarks/`, one dated file per measurement.",
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
            f"Added link delay: {link.get('delay_ms', 0):g} ms; the bounds are bytes / bandwidth.",
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
    if "wan" in figures:
        parts += ["## 8. Emulated wide-area network", wan_section(figures["wan"])]
    return "\n\n".join(parts) + "\n"
