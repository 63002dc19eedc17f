"""The benchmarks' pure helpers: bandwidth bounds, throughput windows, round times, the JSON summary and the report."""

from __future__ import annotations

import json
import math
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from bench import report
from bench.cpu import KINDS
from bench.formulas import (
    SUMMARY_KEYS,
    allreduce_bound_s,
    allreduce_bytes_per_peer,
    epoch_target_batch_size,
    mean,
    paper_scaling,
    ratio,
    round_times,
    steady_window,
    summary_json,
    time_split,
    total_samples_per_second,
    transfer_bound_s,
)
from bench.netpeer import agree, model_like_shapes
from bench.plain import throughput
from bench.records import synthetic_records
from bench.slow_peer import peer_counts
from bench.training import against_plain, explain
from collab.schema import parse_metrics

pytestmark = pytest.mark.light


def test_butterfly_bytes_follow_two_n_minus_one_over_n():
    assert allreduce_bytes_per_peer(1_000_000, 2) == 2_000_000  # 2·(1/2)·2P with fp16
    assert allreduce_bytes_per_peer(1_000_000, 4) == 3_000_000
    assert allreduce_bytes_per_peer(1_000_000, 1) == 0.0
    assert allreduce_bytes_per_peer(10, 2, bytes_per_value=4) == 40


def test_bounds_at_100_mbit():
    assert allreduce_bound_s(1_000_000, 2, 100) == pytest.approx(0.16)  # 2 MB at 12.5 MB/s
    assert transfer_bound_s(12_500_000, 100) == pytest.approx(1.0)
    # many peers: each sends and receives almost twice the fp16 model
    assert allreduce_bound_s(1_000_000, 256, 100) == pytest.approx(4e6 * 255 / 256 / 12.5e6)


def test_ratio_is_none_without_a_usable_reference():
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None and ratio(1.0, 0.0) is None and ratio(1.0, None) is None
    assert ratio(math.nan, 1.0) is None


def test_mean_is_none_for_a_run_without_values():
    assert mean([7.0, 8.0]) == 7.5
    assert mean([]) is None and mean(None) is None


def test_steady_window_starts_one_epoch_after_the_last_peer_joined():
    a = [(0.0, 16, 0), (1.0, 16, 1), (2.0, 16, 2), (3.0, 16, 3), (4.0, 16, 3)]
    b = [(1.5, 16, 1), (2.5, 16, 2), (3.5, 16, 3)]  # joined at epoch 1
    assert steady_window([a, b], warmup_epochs=1) == (2.5, 3.5)
    assert total_samples_per_second([a, b], 1) == pytest.approx((16 + 16) / 1.0)  # a at 3.0, b at 3.5


def test_no_window_when_a_peer_never_warms_up_or_is_missing():
    assert steady_window([[(0.0, 16, 0)], [(0.5, 16, 0)]], 1) is None
    assert steady_window([[(0.0, 16, 0)], []], 1) is None
    assert total_samples_per_second([], 1) is None


def _peer(step: float, boundary: float, epochs: int, per_epoch: int, start: float = 0.0) -> list:
    """Steps of a peer whose micro-step takes ``step`` s, and the first step of each epoch ``boundary`` s more."""
    steps, t = [], start
    for epoch in range(epochs):
        for index in range(per_epoch):
            t += step + (boundary if index == 0 and epoch else 0.0)
            steps.append((t, 16, epoch))
    return steps


def test_time_split_separates_the_micro_step_from_what_each_epoch_boundary_adds():
    a = _peer(0.25, 0.5, epochs=6, per_epoch=10)
    b = _peer(0.30, 0.1, epochs=6, per_epoch=10, start=0.05)
    split = time_split([a, b], 1)
    assert split["step_s"] == pytest.approx((0.25 + 0.30) / 2)
    assert split["extra_s_per_epoch"] == pytest.approx((0.5 + 0.1) / 2)
    assert split["epoch_s"] == pytest.approx((10 * 0.25 + 0.5 + 10 * 0.30 + 0.1) / 2)  # whole epochs only
    assert split["samples_per_step"] == 16
    # with no boundary cost, the epoch factor is 1 and the peer's efficiency is its step's alone
    assert time_split([_peer(0.25, 0.0, 4, 10), _peer(0.25, 0.0, 4, 10)], 1)["extra_s_per_epoch"] == pytest.approx(0)
    assert time_split([a[:25], b[:25]], 1) is None  # the window holds no whole epoch


def test_round_lasts_from_the_last_trigger_to_the_last_finish():
    assert round_times([[(0.0, 1.0), (5.0, 5.5)], [(0.2, 0.9), (5.1, 5.7)]]) == pytest.approx([0.8, 0.6])
    with pytest.raises(ValueError):
        round_times([[(0.0, 1.0)], []])


def test_a_slow_peers_counts_come_from_its_events():
    events = [
        {"event": "step_begun", "epoch": 4},
        {"event": "averaged", "kind": "gradients", "group_size": 3},
        {"event": "averaged", "kind": "parameters", "group_size": 3},
        {"event": "step_begun", "epoch": 5},
        {"event": "round_given_up", "seconds": 7.5},
        {"event": "step_begun", "epoch": 6},
        {"event": "averaged", "kind": "gradients", "group_size": 2},
    ]
    counts = peer_counts(events, peers=3)
    assert counts["steps"] == 3 and counts["averaged"] == 2 and counts["averaged_with_all"] == 1
    assert counts["given_up"] == 1 and counts["out_of_sync"] == 0


def test_paper_scaling_rows():
    rows = paper_scaling(1_000_000, [2, 64], 100, aggregate_ms_per_record=0.01)
    assert [row["peers"] for row in rows] == [2, 64]
    assert rows[0]["allreduce_bound_s"] == pytest.approx(0.16) and rows[1]["aggregate_ms"] == pytest.approx(0.64)


def test_summary_is_one_json_line_with_every_key():
    line = summary_json({"collab_efficiency": 0.971234567, "scaling": {"2": 0.5}, "aggregate_ms_10k": math.inf})
    assert "\n" not in line
    summary = json.loads(line)
    assert list(summary) == list(SUMMARY_KEYS)
    assert summary["collab_efficiency"] == 0.9712 and summary["scaling"] == {"2": 0.5}
    assert summary["aggregate_ms_10k"] is None and summary["join_vs_bound"] is None
    with pytest.raises(KeyError):
        summary_json({"samples": 1})


@pytest.mark.parametrize("params", [1_000_000, 10_000_000, 50_000_000])
def test_model_like_shapes_are_about_the_asked_size(params):
    numel = sum(math.prod(shape) for shape in model_like_shapes(params))
    assert 0.85 * params < numel < 1.15 * params


def test_the_peers_of_a_timed_round_agree_to_try_again_when_any_one_failed(tmp_path):
    def outcomes(phase: str, succeeded: list[bool]) -> list[bool]:
        with ThreadPoolExecutor(len(succeeded)) as pool:
            peers = len(succeeded)
            calls = [pool.submit(agree, tmp_path, phase, rank, peers, ok) for rank, ok in enumerate(succeeded)]
            return [call.result(timeout=30) for call in calls]

    assert outcomes("round0_try0", [True, True, True]) == [True, True, True]
    assert outcomes("round1_try0", [True, False, True]) == [False, False, False]
    assert outcomes("round1_try1", [True, True, True]) == [True, True, True]


def test_synthetic_records_are_valid_and_unexpired():
    records = synthetic_records(3, now=0.0)
    assert all(parse_metrics(value) is not None and expiration > 0 for value, expiration in records.values())


def _run(sps: float, around: list[float], **extra) -> dict:
    return {
        "samples_per_second": sps,
        "plain_around": around,
        "efficiency": sps / (sum(around) / 2),
        "window_s": 40.0,
        "averaging_rounds": [4, 4],
        "cpu": {kind: 0.5 for kind in KINDS},
        **extra,
    }


def test_report_shows_each_run_against_the_plain_pairs_around_it():
    split = {"step_s": 0.4, "plain_step_s": 0.36, "extra_s_per_epoch": 1.0, "epoch_s": 10.0, "samples_per_step": 16}
    training = {
        "plain_samples_per_second": [100.0, 80.0, 90.0],
        "plain_cpu": [{kind: 1.0 for kind in KINDS}, None, {kind: 0.5 for kind in KINDS}],
        "default_target": 1024,
        "anchor": _run(72.0, [80.0, 90.0]),
        "variants": [_run(85.0, [80.0, 90.0], setting="average_state_every 2")],
        "sweep": [_run(90.0, [100.0, 80.0], target_batch_size=1024, time_split=split)],
        "parity": {"steps": 8, "collab_losses": [7.0, 7.0], "reference_loss": 7.0, "ratio": 1.0},
    }
    header = {"date": "2026-11-24", "command": "make bench", "wall_min": 1.0, "machine": "test"}
    text = report.render(header, {"training": training}, "{}")
    assert "3 pairs of plain loops ran" in text and "80.0 to 100.0 samples/s" in text
    assert "| 1024 | 90.00 | 100.0 / 80.0 | 1.00 | 40.00 | 4/4 |" in text
    assert "| 1024 (seed anchor) | 72.00 | 80.0 / 90.0 | 0.85 |" in text
    assert "| average_state_every 2 | 85.00 | 80.0 / 90.0 | 1.00 | 4/4 |" in text
    assert "| plain loops (mean of 2 pairs) | " + " | ".join(["0.75"] * len(KINDS)) in text
    # step factor 0.36 / 0.4, epoch factor 1 - 1 / 10; runs without a split (the anchor here) have no row
    assert "| target_batch_size 1024 | 0.400 | 0.360 | 0.90 | 1.00 | 10.00 | 0.90 | 0.81 | 1.00 |" in text
    assert "| seed anchor | 0." not in text


def test_a_run_is_divided_by_the_mean_of_the_plain_pairs_around_it():
    after = {"samples_per_second": 80.0}
    run = against_plain({"samples_per_second": 90.0}, {"samples_per_second": 100.0}, after)
    assert run["plain_around"] == [100.0, 80.0] and run["efficiency"] == pytest.approx(1.0)
    split = {"step_s": 0.3, "extra_s_per_epoch": 0.5, "epoch_s": 10.0, "samples_per_step": 16}
    timed = against_plain({"samples_per_second": 90.0, "time_split": split}, {"samples_per_second": 100.0}, after)
    assert timed["time_split"]["plain_step_s"] == pytest.approx(2 * 16 / 90.0)  # each of two loops at 45 samples/s
    assert explain(timed) == (
        "efficiency 1.00: a micro-step takes 0.300 s against the plain loops' 0.356 s, and each 10.0 s epoch adds "
        "0.50 s at its boundary"
    )
    missing = against_plain({"samples_per_second": None}, {"samples_per_second": 100.0}, {"samples_per_second": 80.0})
    assert missing["efficiency"] is None  # a collaborative run that never reached steady state has no efficiency
    assert explain(missing) == "no steady window (see the peers' logs)"


def test_gpu_target_batch_is_a_power_of_two_lasting_the_epoch():
    assert epoch_target_batch_size(116.0, 9.0) == 2048  # 1044 samples in 9 s
    assert epoch_target_batch_size(50.0, 9.0) == 1024  # never below the default
    assert epoch_target_batch_size(5000.0, 9.0) == 65536  # 45,000 samples in 9 s


def test_report_shows_the_gpu_figures_or_why_they_are_missing():
    header = {"date": "2026-11-24", "command": "make bench", "wall_min": 1.0, "machine": "test"}
    assert "PyTorch saw no CUDA device" in report.render(header, {}, "{}")
    gpu = {
        "device": "NVIDIA H100 80GB HBM3",
        "target_batch_size": 65536,
        "per_peer_samples_per_second": 900.0,
        "plain_per_loop": [1000.0, 950.0],
        "efficiency": 900.0 / 975.0,
        "averaging_rounds": [5, 5],
        "window_s": 40.0,
        "modes": [
            {
                "setting": "base bf16 sync",
                "per_peer_samples_per_second": 410.5,
                "averaging_rounds": [7, 6],
                "dropped_batches": [0, 12],
                "window_s": 20.0,
            },
            {"setting": "base bf16 lowcomm H=4 8bit", "error": "RuntimeError: peers exited with [1, 0]"},
        ],
        "loss": {
            "sync": {"held_out_loss": [7.0333, 7.0334]},
            "lowcomm": {"error": "RuntimeError: peers exited with [0, 1]"},
            "global_batches": 32,
            "target_batch_size": 2048,
            "local_steps": 4,
            "ratio": None,
        },
    }
    text = report.render(header, {"gpu": gpu}, "{}")
    assert "Device: **NVIDIA H100 80GB HBM3**; target_batch_size 65536." in text
    assert "| plain HF AMP loops (before / after) | 1000.0 / 950.0 |" in text
    assert "| collaborating peers (fp16) | 900.00 | 0.92 | 40.00 | 5/5 |" in text
    assert "| base bf16 sync | 410.50 | 20.00 | 7/6 | 0/12 |" in text
    assert "| base bf16 lowcomm H=4 8bit | failed: RuntimeError: peers exited with [1, 0] |  |  |  |" in text
    assert (
        "after the same 32 global batches of 2048: synchronous **7.033 / 7.033**, low-communication (H=4, 8-bit) "
        "**failed: RuntimeError: peers exited with [0, 1]**; ratio low-communication / synchronous **n/a**."
    ) in text


@pytest.mark.timeout(120)
def test_plain_fp16_loop_runs_autocast_with_loss_scaling():
    # bench.plain's GPU side on CPU (PyTorch runs fp16 autocast and GradScaler there too): it trains and scales. A
    # step takes about 2.5 s in fp16 on CPU, so one untimed step and one timed.
    result = throughput(seconds=0.01, seed=0, device="cpu", fp16=True, warm_up_steps=1)
    assert result["samples_per_second"] > 0 and result["device"] == "cpu"
    assert 1.0 <= result["loss_scale"] <= 65536.0  # started at 65536, halves on each overflow, never grows in 2 steps
    assert throughput(seconds=0.5, seed=0)["loss_scale"] is None


def test_report_renders_this_runs_figures_only():
    # Findings and history live in docs/benchmarks/: the generated report carries no other run's dates or figures.
    header = {"date": "2000-01-02", "command": "make bench", "wall_min": 1.0, "machine": "test"}
    row = {
        "params": 1000,
        "allreduce_s": 0.2,
        "allreduce_bound_s": 0.1,
        "allreduce_vs_bound": 2.0,
        "join_s": 0.4,
        "join_bytes": 4000,
        "join_bound_s": 0.2,
        "join_vs_bound": 2.0,
    }
    eight_bit = {"params": 1000, "allreduce_s": 0.1, "allreduce_vs_fp16_bound": 1.0, "speedup_over_fp16": 2.0}
    link = {"bandwidth_mbit": 10.0, "delay_ms": 20, "rows": [row], "eight_bit": eight_bit, "goodput_mbit": 9.5}
    text = report.render(header, {"link": link}, "{}")
    assert re.findall(r"\d{4}-\d{2}-\d{2}", text) == ["2000-01-02"]
    assert "Added link delay: 20 ms" in text and "on a 10 Mbit/s link" in text
    assert "Findings" not in text and "docs/benchmarks/" in text


def test_the_report_names_the_command_that_ran():
    import argparse

    from bench.__main__ import run_header

    def command(**args) -> str:
        return run_header(60.0, argparse.Namespace(**{"quick": False, "only": None, **args}))["command"]

    assert command() == "make bench"
    assert command(only=["training", "link"]) == "python -m bench --only training link"
    assert command(quick=True, only=["gpu"]) == "python -m bench --quick --only gpu"


def test_make_bench_leaves_the_settings_tried_to_their_own_part():
    """make bench stays under an hour on two cores: the settings tried run only when asked for."""
    from bench.__main__ import default_parts, parse

    assert "variants" not in default_parts() and "training" in default_parts() and "wan" in default_parts()
    assert parse(["--only", "training", "variants"]).only == ["training", "variants"]
