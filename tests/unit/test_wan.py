"""The emulated WAN: rate scaling's arithmetic, the shadow model's shapes, and the hub network itself (root only)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench.formulas import MBIT
from bench.procs import Child, children, hub_network, link_bytes, tcp_counters
from bench.shadow import gpt2_shapes, shadow_numel
from bench.wan import (
    MAX_WINDOW_S,
    SETTING,
    SUMMARY_KEYS,
    Setting,
    bits_per_param_per_step,
    busy_fraction,
    comm_to_compute,
    compute_s,
    lowcomm_flags,
    outer_rounds_for,
    round_counts,
    scaled_rate_mbit,
    summarize,
    window_closed,
    window_figures,
)

pytestmark = pytest.mark.light


def test_setting_ratio_is_round_time_over_compute_time():
    # 3 peers: 2·(2/3)·110M·2 bytes = 293.3 MB at 12.5 MB/s = 23.47 s; 6·110M·174762 tokens at 60 TFLOP/s = 1.922 s
    assert comm_to_compute(SETTING) == pytest.approx(23.4667 / 1.92238, rel=1e-4)


def test_scaled_rate_keeps_the_ratio():
    # The setting's own model and compute time give back the setting's own link.
    own = compute_s(SETTING.params, SETTING.tokens_per_peer_per_epoch, SETTING.gpu_flops)
    assert scaled_rate_mbit(SETTING, SETTING.params, own) == pytest.approx(SETTING.link_mbit)
    # 1.45M parameters computed in 8 s an epoch: round of 3.867 MB must last R·8 s.
    rate = scaled_rate_mbit(SETTING, 1_450_000, 8.0)
    round_s = 2 * 2 / 3 * 1_450_000 * 2 / (rate * MBIT)
    assert round_s / 8.0 == pytest.approx(comm_to_compute(SETTING))
    assert rate == pytest.approx(0.3168, rel=1e-3)
    # A machine twice as slow needs a link twice as slow.
    assert scaled_rate_mbit(SETTING, 1_450_000, 16.0) == pytest.approx(rate / 2)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="link_mbit"):
        dataclasses.replace(SETTING, link_mbit=0)
    with pytest.raises(ValueError, match="peers"):
        Setting("one", 1, 1.0, 1.0, 1, peers=1)
    with pytest.raises(ValueError, match="epoch_compute_s"):
        scaled_rate_mbit(SETTING, 1000, 0.0)


def test_bits_per_param_per_step():
    # 8-bit values both ways of a 2-peer all-reduce (P bytes each way) every 100 steps: 2·8/100 = 0.16.
    assert bits_per_param_per_step(2_000_000, 1_000_000, 100) == pytest.approx(0.16)
    assert bits_per_param_per_step(10, 1_000, 0) is None


def test_window_counts_samples_steps_and_epochs_inside_it():
    peers = [
        [[1.0, 16, 0], [2.0, 16, 0], [3.0, 16, 1], [4.0, 16, 1], [5.0, 16, 2], [7.0, 16, 2]],
        [[1.5, 16, 0], [2.5, 16, 1], [3.5, 16, 1], [6.5, 16, 3]],
    ]
    window = window_figures(peers, 2.0, 6.0)
    assert window.records == [3, 2]
    assert window.epochs == [2, 1]
    assert window.samples_per_second == pytest.approx(5 * 16 / 4.0)
    with pytest.raises(ValueError):
        window_figures(peers, 3.0, 3.0)


def test_busy_fraction_counts_a_peer_s_waits_beyond_twice_its_pace():
    # steps every second from 1 to 4, a 6-s wait, then steps at 11 and 12; window (0, 13]
    times = [1.0, 2.0, 3.0, 4.0, 10.0, 11.0, 12.0]
    # intervals 1 (from the start), 1, 1, 1, 6 -> 2, 1, 1, 1 (to the end): 9 s computing of 13
    assert busy_fraction(times, 0.0, 13.0) == pytest.approx(9 / 13)
    assert busy_fraction([1.0, 2.0, 3.0, 4.0], 0.0, 4.0) == pytest.approx(1.0)  # never waited
    assert busy_fraction([1.0, 2.0], 0.0, 4.0) is None  # too few steps to know a pace
    window = window_figures([[[t, 16, 0] for t in times], [[1.0, 16, 0]]], 0.0, 13.0)
    assert window.busy == [pytest.approx(9 / 13), None]


def test_shadow_shapes_are_gpt2_small():
    import torch
    from transformers import GPT2Config, GPT2Model

    with torch.device("meta"):
        model = GPT2Model(GPT2Config())
    assert shadow_numel() == sum(p.numel() for p in model.parameters()) == 124_439_808
    assert sorted(gpt2_shapes()) == sorted(tuple(p.shape) for p in model.parameters())


def test_link_bytes_reads_the_kernel_counters():
    text = '[{"ifname":"x","stats64":{"rx":{"bytes":12,"packets":1},"tx":{"bytes":34,"packets":2}}}]'
    assert link_bytes(text) == {"tx_bytes": 34, "rx_bytes": 12}


# The kernel's layout (Linux 6.x, columns left out): a line of names, then one of values, per table; netstat's follow.
PROC_NET = """Ip: Forwarding DefaultTTL InReceives
Ip: 1 64 900
Tcp: RtoAlgorithm MaxConn ActiveOpens EstabResets CurrEstab InSegs OutSegs RetransSegs OutRsts
Tcp: 1 -1 5 2 3 700 650 17 1
Udp: InDatagrams NoPorts
Udp: 4 0
TcpExt: SyncookiesSent TCPTimeouts TCPLossProbes
TcpExt: 0 6 9
IpExt: InNoRoutes InOctets
IpExt: 0 81000
"""


def test_tcp_counters_reads_each_table_by_its_names_and_refuses_a_table_without_them():
    assert tcp_counters(PROC_NET) == {
        "sent_segments": 650,
        "retransmitted_segments": 17,
        "established_resets": 2,
        "retransmission_timeouts": 6,
    }
    without_netstat = PROC_NET.split("TcpExt:")[0]
    with pytest.raises(ValueError, match="retransmission_timeouts"):
        tcp_counters(without_netstat)


RATE_MBIT = 2.0
PAYLOAD_MB = 0.25


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="network namespaces need root and `ip`")
def test_hub_shapes_and_counts_a_transfer(tmp_path):
    """Two namespaces through the hub: 250 kB each way at 2 Mbit/s take 1 s or more, and the kernel counts them."""
    with hub_network(2, RATE_MBIT, RATE_MBIT, prefix="wantest", subnet="10.79.0") as network:
        server, client = network.peers
        before = network.counters()
        tcp_before = network.tcp_counters()
        with children() as started:
            for role, peer in (("serve", server), ("send", client)):
                args = [role, server.address, 5999, PAYLOAD_MB]
                started.append(Child("bench.linktest", args, tmp_path / f"{role}.log", 30, netns=peer.netns))
            assert [child.wait() for child in started] == [0, 0], started[1].log()
            results = [child.log().split()[-2:] for child in started]
        after = network.counters()
        tcp_after = network.tcp_counters()
        names = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
        assert {"wantest_hub", "wantest_0", "wantest_1"} <= names
        # a namespace starts with the host's default algorithm, which the figures name
        host = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
        assert network.congestion_control() == host
        for peer in network.peers:  # the only route is the hub's subnet: a peer reaches no other host
            routes = subprocess.run(["ip", "-n", peer.netns, "route"], capture_output=True, text=True).stdout
            assert [line.split()[0] for line in routes.splitlines()] == ["10.79.0.0/24"]
    payload = int(PAYLOAD_MB * 1e6)
    for received, seconds in results:
        assert int(received) == payload
        # tbf lets a 4 kB burst through at once; the rest goes at the rate
        assert float(seconds) >= (payload - 4000) * 8 / (RATE_MBIT * 1e6)
    for start, end in zip(before, after, strict=True):
        assert end["tx_bytes"] - start["tx_bytes"] >= payload
        assert end["rx_bytes"] - start["rx_bytes"] >= payload
    # each namespace's own TCP counters, not this machine's: nothing had connected there before the transfer
    assert all(set(counts.values()) == {0} for counts in tcp_before), tcp_before
    # both ends read all they expect before they close: the connection ends without a reset
    assert [counts["established_resets"] for counts in tcp_after] == [0, 0], tcp_after
    names = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    assert not names & {"wantest_hub", "wantest_0", "wantest_1"}


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="network namespaces need root and `ip`")
def test_hub_is_removed_when_the_block_fails():
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt), hub_network(2, 10.0, 10.0, prefix="wantest", subnet="10.79.0"):
        raise KeyboardInterrupt
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "wantest" not in names
    assert time.monotonic() - started < 10


def _run(samples_per_second: float, **extra) -> dict:
    return {"samples_per_second": samples_per_second, "window_s": 60.0, **extra}


def wan_figures(lowcomm: dict) -> dict:
    return {
        "setting": dataclasses.asdict(SETTING),
        "rate_scaled": {
            "params": 1_450_000,
            "epoch_compute_s": 4.0,
            "comm_to_compute": 12.2,
            "rate_mbit": 0.634,
            "alone": _run(100.0),
            "sync": _run(
                20.0, efficiency=0.2, bits_per_param_per_step=40.0, averaging_rounds=[5, 6], rounds_given_up=[1, 0]
            ),
            "lowcomm": lowcomm,
        },
        "shadow": {
            "params": 124_439_808,
            "micro_batch_s": 0.2,
            "rate_mbit": 100.0,
            "alone": _run(80.0),
            "sync": _run(8.0, efficiency=0.1, bits_per_param_per_step=33.0),
        },
    }


def test_summary_takes_the_best_low_communication_variant():
    runs = {"H 50, 8bit": _run(90.0, efficiency=0.9, bits_per_param_per_step=0.3)}
    runs["H 200, topk"] = _run(97.0, efficiency=0.97, bits_per_param_per_step=0.004)
    summary = summarize(wan_figures(runs))
    assert summary["wan_efficiency_sync"] == 0.2 and summary["wan_efficiency_lowcomm"] == 0.97
    assert summary["bits_per_param_per_step"]["H 200, topk"] == 0.004
    assert summary["lowcomm_loss_ratio"] is None
    assert set(summary) == {*SUMMARY_KEYS, "wan_busy_sync", "wan_busy_lowcomm"}


def test_the_loss_runs_give_the_ratio_at_equal_samples_and_the_report_names_every_loss():
    from bench.report import wan_section

    figures = wan_figures({"H 50, 8bit": None})
    figures["loss"] = {
        "lowcomm": {"samples": [16016, 16000, 15984], "exit_codes": [0, 0, 0], "losses": [6.1, 6.3]},
        "sync": {"global_batches": 188, "samples": 48128, "loss": 6.0},
        "ratio": 1.0333,
        "variant": "--local_steps 50",
        "common": "--target_batch_size 256 --learning_rate 0.05",
        "links": "the rate-scaled way's links",
    }
    assert summarize(figures)["lowcomm_loss_ratio"] == 1.0333
    text = wan_section(figures)
    assert "at equal samples (real compute, --target_batch_size 256 --learning_rate 0.05)" in text
    assert (
        "low-communication (--local_steps 50, on the rate-scaled way's links) 6.1000, 6.3000 after 48000 samples in "
        "all ([16016, 16000, 15984] per peer)"
    ) in text
    assert "6.0000 after 188 global batches (48128 samples); ratio **1.0333**" in text


def test_the_reference_loop_takes_the_loss_runs_learning_rate(tmp_path, sample_data):
    """The loss ratio's synchronous side trains at the loss runs' rate: one step at 0.05 moves the model less than
    one at the default 0.2, from the same initialisation and batches."""
    from bench.plain import reference

    def moved(learning_rate):
        # warmup_steps 2: the second step runs at half the peak rate; a rate near 0 leaves the loss where it was
        return reference(2, 32, seed=0, learning_rate=learning_rate)["loss"]

    untrained = moved(1e-12)
    slow, fast = moved(0.05), moved(None)
    assert abs(untrained - slow) < abs(untrained - fast)


def test_report_marks_variants_not_available_and_names_each_way():
    from bench.report import wan_section

    text = wan_section(wan_figures({"H 50, 8bit": None}))
    assert summarize(wan_figures({"H 50, 8bit": None}))["wan_efficiency_lowcomm"] is None
    assert "Not available in this run" in text and "H 50, 8bit" in text
    assert "| synchronous (rate scaling) | 0.634 | 20.00 | 0.20 | n/a | 40.0000 | 60.00 | 5 (1) / 6 (0) |" in text
    assert "| synchronous (shadow compute) | 100.000 |" in text
    assert "congestion control" not in text  # figures from before it was recorded name none
    assert wan_section({"skipped": "network namespaces unavailable"}).startswith("Not measured")


def test_report_names_the_tcp_congestion_control_the_namespaces_ran():
    from bench.report import wan_section

    figures = wan_figures({"H 50, 8bit": None})
    figures["rate_scaled"]["congestion_control"] = "bbr"
    figures["shadow"]["congestion_control"] = "cubic"
    assert (
        "No added delay or loss (this kernel has no sch_netem). TCP congestion control in the namespaces: bbr, cubic."
    ) in wan_section(figures)


def test_report_says_when_the_peers_ran_over_quic_not_the_namespaces_tcp():
    from bench.report import wan_section

    figures = wan_figures({"H 50, 8bit": None})
    for way in ("rate_scaled", "shadow"):
        figures[way] |= {"congestion_control": "bbr", "transport": "quic"}
    text = wan_section(figures)
    assert "Peers connected over QUIC (UDP, with quic-go's own congestion control)." in text
    assert "TCP congestion control" not in text  # the namespaces' TCP carried none of the peers' traffic


def test_wan_bench_refuses_a_transport_it_does_not_know():
    result = subprocess.run(
        [sys.executable, "-m", "bench.wan", "--transport", "sctp"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "--transport: invalid choice: 'sctp'" in result.stderr


def test_a_peer_listens_on_the_transport_asked_for():
    from bench.procs import WanPeer

    peer = WanPeer("wan_0", "10.78.0.1", "wan_0_p")
    assert peer.listen_maddr() == "/ip4/10.78.0.1/tcp/0"
    assert peer.listen_maddr("quic") == "/ip4/10.78.0.1/udp/0/quic-v1"


def test_report_shows_each_low_communication_run_between_its_own_alone_runs():
    from bench.report import wan_section

    run = _run(90.0, efficiency=0.9, busy_fraction=0.97, bits_per_param_per_step=0.08, alone=_run(100.0))
    run |= {"averaging_rounds": [2, 2], "rounds_given_up": [0, 1], "parameter_rounds": [1, 0]}
    run["tcp"] = [
        {"sent_segments": 900, "retransmitted_segments": 40, "established_resets": 0, "retransmission_timeouts": 3},
        {"sent_segments": 800, "retransmitted_segments": 2, "established_resets": 1, "retransmission_timeouts": 0},
    ]
    run["alone_after"] = _run(104.0)
    lines = wan_section(wan_figures({"H 50, 8bit": run})).splitlines()
    alone = lines.index(
        "| alone, low-communication H 50, 8bit (rate scaling) | no link | 100.00 | n/a | n/a | n/a | 60.00 |  |  |  |"
    )
    assert lines[alone + 1] == (
        "| low-communication H 50, 8bit (rate scaling) | 0.634 | 90.00 | 0.90 | 0.97 | 0.0800 | 60.00 | 2 (0) / 2 (1) "
        "| 1 / 0 | 3 (0) / 0 (1) |"
    )
    assert lines[alone + 2] == (
        "| alone after, low-communication H 50, 8bit (rate scaling) | no link | 104.00 | n/a | n/a | n/a | 60.00 "
        "|  |  |  |"
    )


def test_variants_of_one_h_share_their_alone_runs_in_the_order_each_h_first_appears():
    from bench.wan import lowcomm_flags, variants_by_local_steps

    variants = {
        "H 50, 8bit": lowcomm_flags(50, "8bit"),
        "H 25, 8bit": lowcomm_flags(25, "8bit"),
        "H 50, topk": lowcomm_flags(50, "topk"),
    }
    groups = variants_by_local_steps(variants)
    assert list(groups) == ["50", "25"]
    assert [name for name, _ in groups["50"]] == ["H 50, 8bit", "H 50, topk"]
    assert groups["25"] == [("H 25, 8bit", variants["H 25, 8bit"])]


def test_the_alone_reference_is_the_mean_of_the_runs_before_and_after():
    from bench.wan import bracketed_rate

    assert bracketed_rate({"samples_per_second": 100.0}, {"samples_per_second": 110.0}) == 105.0
    # a run that measured nothing leaves the other as the reference; neither, no reference
    assert bracketed_rate({"samples_per_second": 100.0}, {"samples_per_second": None}) == 100.0
    assert bracketed_rate({}, {"samples_per_second": None}) is None


def test_window_holds_two_whole_epochs_within_bounds():
    assert not window_closed(59.0, 60.0, 5)  # too short, however many epochs
    assert window_closed(60.0, 60.0, 2)
    assert not window_closed(200.0, 60.0, 1)  # together: two whole epochs, however long
    assert window_closed(60.0, 60.0, None)  # alone: the seconds only
    assert window_closed(MAX_WINDOW_S, 60.0, 0)  # never past the bound


def test_bench_summary_line_and_report_carry_the_wan_part():
    import json

    from bench import report
    from bench.__main__ import summarize as bench_summary

    lowcomm = _run(90.0, efficiency=0.9, bits_per_param_per_step=0.08, busy_fraction=0.95)
    figures = {"wan": wan_figures({"H 50, 8bit": lowcomm})}
    line = json.loads(bench_summary(figures))
    assert line["wan_efficiency_sync"] == 0.2 and line["wan_efficiency_lowcomm"] == 0.9
    assert line["wan_busy_lowcomm"] == 0.95 and line["wan_busy_sync"] is None
    assert line["bits_per_param_per_step"] == {"shadow_sync": 33.0, "sync": 40.0, "H 50, 8bit": 0.08}
    assert json.loads(bench_summary({}))["wan_efficiency_sync"] is None
    header = {"date": "2026-11-25", "command": "make bench", "wall_min": 1.0, "machine": "test"}
    assert "## 8. Emulated wide-area network" in report.render(header, figures, json.dumps(line))


def test_link_rates_are_bounded_before_anything_is_made():
    for rate in (0.0, -1.0, math.nan, math.inf, 1e9):
        with pytest.raises(ValueError, match="link rate"), hub_network(2, rate, 10.0, prefix="wantest"):
            pass


def test_shadow_arguments_are_bounded():
    from arguments import ConfigError
    from bench.shadow import ShadowArguments

    for bad, flag in (({"layers": 0}, "--layers"), ({"micro_batch_s": math.nan}, "--micro_batch_s")):
        with pytest.raises(ConfigError, match=f"^{flag}:"):
            ShadowArguments(**bad)
    with pytest.raises(ConfigError, match="^--micro_batch_s:"):
        ShadowArguments(micro_batch_s=1e9)


def test_shadow_peer_refuses_a_bad_flag_in_one_line_and_writes_nothing(tmp_path):
    steps = tmp_path / "steps.jsonl"
    command = [sys.executable, "-m", "bench.shadow", str(steps), "--layers", "49"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench.shadow: error: --layers: must be 1 to 48"), lines
    assert not steps.exists()


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--loss_local_steps", "0"], "--loss_local_steps"),
        (["--loss_local_steps", "1001"], "--loss_local_steps"),
        (["--loss_variant", "25:topk:2"], "--loss_variant: '25:topk:2'"),
        (["--loss_variant", "25:topk", "--loss_local_steps", "25"], "--loss_variant: give it or --loss_local_steps"),
        (["--shadow_topk_fraction", "0"], "--shadow_topk_fraction: --topk_fraction must be in (0, 1]"),
    ],
)
def test_a_bad_h_variant_or_fraction_is_refused_in_one_line_before_anything_runs(tmp_path, capsys, flags, named):
    from bench.wan import main

    # in this process: the rate-scaled test below runs the command itself, exit status included
    with pytest.raises(SystemExit) as exited:
        main(["--ways", "loss", "--log_dir", str(tmp_path / "logs"), *flags])
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("python -m bench.wan: error:") and named in lines[-1], lines
    assert not (tmp_path / "logs").exists()


def test_a_rate_scaled_variant_names_its_h_and_compression_and_bad_ones_are_refused_in_one_line(tmp_path):
    from bench.wan import parse_variant

    assert parse_variant("25:8bit") == (
        "H 25, 8bit",
        ["--local_steps", "25", "--outer_learning_rate", "0.7", "--outer_momentum", "0.9"]
        + ["--pseudo_grad_compression", "8bit"],
    )
    assert parse_variant("25:topk:0.03") == (
        "H 25, topk 0.03",
        [*parse_variant("25:topk")[1], "--topk_fraction", "0.03"],
    )
    bad_ones = ("25", "0:8bit", "1001:topk", "25:int4", "\uff12\uff15:8bit", ":8bit", "25:8bit:0.03", "25:topk:0")
    for bad in (*bad_ones, "25:topk:1.5", "25:topk:nan", "25:topk:\uff10.5", "25:topk:"):
        with pytest.raises(ValueError, match="must be H:COMPRESSION or H:topk:FRACTION"):
            parse_variant(bad)
    command = [sys.executable, "-m", "bench.wan", "--ways", "rate_scaled", "--log_dir", str(tmp_path / "logs")]
    result = subprocess.run(
        [*command, "--lowcomm_variants", "50:topk", "25:int4"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("python -m bench.wan: error: --lowcomm_variants: '25:int4'"), lines
    assert not (tmp_path / "logs").exists()


def test_the_shadow_inner_step_moves_the_parameters_once_a_round():
    from bench.shadow import ShadowInnerStep

    model = torch.nn.Linear(4, 2)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    before = [param.detach().clone() for param in model.parameters()]
    inner = ShadowInnerStep(model, local_steps=3, learning_rate=0.5)
    moved = []
    for _ in range(6):
        inner.step()
        moved.append(round(float((model.weight.detach() - before[0]).mean()), 6))
    assert moved == [-0.5, -0.5, -0.5, -1.0, -1.0, -1.0]  # one step of 0.5 per 3 calls, at the round's first


def test_shadow_runs_without_their_alone_run_keep_their_figures_without_an_efficiency():
    from bench.wan import shadow_together

    def run(samples_per_second):  # one peer's window: 1000 inner steps, 250 MB sent and received
        return {"samples_per_second": samples_per_second, "epochs": [10], "records": [1000], "link_bytes": [250e6]}

    lowcomm_only = shadow_together({"lowcomm": run(148.0)}, numel=125_000_000)
    assert lowcomm_only["lowcomm"]["efficiency"] is None and lowcomm_only["lowcomm"]["alone"] is None
    assert lowcomm_only["lowcomm"]["bits_per_param_per_step"] == pytest.approx(250e6 * 8 / 125e6 / 1000)
    both = shadow_together({"lowcomm_alone": run(150.0), "lowcomm": run(120.0)}, numel=125_000_000)
    assert both["lowcomm"]["efficiency"] == pytest.approx(0.8) and set(both) == {"lowcomm"}


def test_rounds_in_a_window_are_counted_by_kind_from_the_events_file(tmp_path):
    events = tmp_path / "peer.events.jsonl"
    lines = [
        {"time": 5.0, "event": "averaged", "kind": "gradients"},  # before the window
        {"time": 11.0, "event": "averaged", "kind": "gradients"},
        {"time": 12.0, "event": "averaged", "kind": "parameters"},
        {"time": 13.0, "event": "round_given_up", "seconds": 2.0, "reason": "time"},
        {"time": 14.0, "event": "averaged", "kind": "gradients"},
        {"time": 21.0, "event": "averaged", "kind": "parameters"},  # after it
    ]
    events.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert round_counts(events, 10.0, 20.0, "averaged") == 2
    assert round_counts(events, 10.0, 20.0, "averaged", parameters=True) == 1
    assert round_counts(events, 10.0, 20.0, "round_given_up") == 1
    assert round_counts(tmp_path / "none.jsonl", 10.0, 20.0, "averaged") is None


def test_loss_runs_stop_at_a_round_end_holding_the_samples_asked_for():
    # 3 peers x 1000 micro-batches of 16 = 48000 samples; an H 50 round at target 256 holds 12800
    assert outer_rounds_for(48_000, 50, 256) == 4
    assert outer_rounds_for(12_800, 50, 256) == 1
    assert outer_rounds_for(12_801, 50, 256) == 2
    assert outer_rounds_for(10, 50, 256) == 1


def with_shadow_runs(topk_fraction=None, long_local_steps=None, **runs) -> dict:
    """wan_figures with shadow runs at H 10 beside one alone run: {mode: (samples/s, efficiency, bits)}."""
    figures, alone = wan_figures({"H 50, 8bit": None}), _run(120.0)
    figures["shadow"] |= {"local_steps": 10, "topk_fraction": topk_fraction, "long_local_steps": long_local_steps}
    for mode, (samples_per_second, efficiency, bits) in runs.items():
        figures["shadow"][mode] = _run(
            samples_per_second, efficiency=efficiency, bits_per_param_per_step=bits, alone=alone
        )
    return figures


def test_the_shadow_topk_run_has_its_row_after_the_8bit_one_and_its_bits_in_the_summary():
    from bench.report import wan_section
    from bench.wan import shadow_runs

    assert shadow_runs(10, 0.03)["lowcomm_topk"][1][-2:] == ["--topk_fraction", "0.03"]
    assert "--topk_fraction" not in shadow_runs(10)["lowcomm_topk"][1]  # the trainer's own default

    figures = with_shadow_runs(
        topk_fraction=0.03,
        lowcomm=(110.0, 0.917, 0.3),
        lowcomm_topk=(114.0, 0.95, 0.004),
    )
    assert summarize(figures)["bits_per_param_per_step"]["shadow_lowcomm_topk"] == 0.004
    lines = wan_section(figures).splitlines()
    eight_bit = next(i for i, line in enumerate(lines) if line.startswith("| low-communication H 10, 8bit (shadow"))
    topk_row = "| low-communication H 10, topk 0.03 (shadow compute) | 100.000 | 114.00 | 0.95 |"
    assert lines[eight_bit + 1].startswith(topk_row)
    assert sum(line.startswith("| alone, low-communication H 10") for line in lines) == 1  # one alone run, shown once


def test_the_shadow_8bit_run_at_a_longer_h_has_its_own_row_and_bits_beside_h_10():
    from bench.report import wan_section
    from bench.wan import shadow_runs

    runs = shadow_runs(10, long_local_steps=20)
    assert runs["lowcomm_long"] == (True, lowcomm_flags(20, "8bit"))
    assert runs["lowcomm"] == (True, lowcomm_flags(10, "8bit"))

    figures = with_shadow_runs(
        long_local_steps=20,
        lowcomm=(110.0, 0.917, 0.10851),
        lowcomm_long=(116.0, 0.967, 0.05432),
    )
    bits = summarize(figures)["bits_per_param_per_step"]
    assert (bits["shadow_lowcomm"], bits["shadow_lowcomm_long"]) == (0.10851, 0.05432)
    lines = wan_section(figures).splitlines()
    long_row = "| low-communication H 20, 8bit (shadow compute) | 100.000 | 116.00 | 0.97 | n/a | 0.0543 |"
    assert any(line.startswith(long_row) for line in lines)
    assert any(" | 0.1085 | " in line for line in lines if "H 10, 8bit (shadow" in line)  # four places: goal 0.1
    assert sum(line.startswith("| alone, low-communication H 10") for line in lines) == 1  # one alone run for both
