"""The benchmarks' pure helpers: bandwidth bounds, throughput windows, round times and the JSON summary."""

from __future__ import annotations

import json
import math

import pytest

from bench.formulas import (
    SUMMARY_KEYS,
    allreduce_bound_s,
    allreduce_bytes_per_peer,
    paper_scaling,
    ratio,
    round_times,
    steady_window,
    summary_json,
    total_samples_per_second,
    transfer_bound_s,
)
from bench.netpeer import model_like_shapes
from bench.records import synthetic_records
from collab.schema import parse_metrics


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


def test_steady_window_starts_one_epoch_after_the_last_peer_joined():
    a = [(0.0, 16, 0), (1.0, 16, 1), (2.0, 16, 2), (3.0, 16, 3), (4.0, 16, 3)]
    b = [(1.5, 16, 1), (2.5, 16, 2), (3.5, 16, 3)]  # joined at epoch 1
    assert steady_window([a, b], warmup_epochs=1) == (2.5, 3.5)
    assert total_samples_per_second([a, b], 1) == pytest.approx((16 + 16) / 1.0)  # a at 3.0, b at 3.5


def test_no_window_when_a_peer_never_warms_up_or_is_missing():
    assert steady_window([[(0.0, 16, 0)], [(0.5, 16, 0)]], 1) is None
    assert steady_window([[(0.0, 16, 0)], []], 1) is None
    assert total_samples_per_second([], 1) is None


def test_round_lasts_from_the_last_trigger_to_the_last_finish():
    assert round_times([[(0.0, 1.0), (5.0, 5.5)], [(0.2, 0.9), (5.1, 5.7)]]) == pytest.approx([0.8, 0.6])
    with pytest.raises(ValueError):
        round_times([[(0.0, 1.0)], []])


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


def test_synthetic_records_are_valid_and_unexpired():
    records = synthetic_records(3, now=0.0)
    assert all(parse_metrics(value) is not None and expiration > 0 for value, expiration in records.values())
