"""monitor.aggregate: the swarm's metrics as a pure function of the records and the time."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collab.schema import MAX_STEP, honest_step
from monitor.aggregate import (
    aggregate,
    count_contributions,
    far_ahead,
    format_line,
    live_metrics,
    summarize,
    top_contributors,
    with_live_progress,
)
from tests.conftest import metrics_record

pytestmark = pytest.mark.light

NOW = 1000.0


def test_no_peers():
    assert aggregate({}, NOW) is None


def test_loss_is_the_mean_over_all_mini_steps():
    metrics = aggregate(
        {
            b"a": (metrics_record(step=3, loss=8.0, mini_steps=4), NOW + 60),
            b"b": (metrics_record(step=4, loss=3.0, mini_steps=1, samples=16, sps=2.5), NOW + 60),
        },
        NOW,
    )
    assert metrics.step == 4
    assert metrics.loss == pytest.approx(11.0 / 5)
    assert (metrics.alive_peers, metrics.samples, metrics.samples_per_second) == (2, 80, 12.5)
    assert metrics.time == NOW


def test_zero_mini_steps_gives_no_loss_instead_of_dividing_by_zero():
    metrics = aggregate({b"a": (metrics_record(loss=0.0, mini_steps=0), NOW + 1)}, NOW)
    assert metrics.loss is None and metrics.alive_peers == 1
    assert "loss n/a" in format_line(metrics.to_dict())


def test_expired_records_are_not_alive():
    metrics = aggregate(
        {
            b"a": (metrics_record(), NOW + 1),
            b"old": (metrics_record(step=9), NOW),
            b"older": (metrics_record(), NOW - 5),
        },
        NOW,
    )
    assert (metrics.alive_peers, metrics.step) == (1, 1)


def test_a_peer_that_stopped_publishing_stops_counting_after_step_lag_epochs():
    # killed at step 4, its record lives for minutes: it must not keep its loss and samples/s in the sums
    records = {
        b"dead": (metrics_record(step=4, loss=80.0, mini_steps=4, samples=64, sps=25.0), NOW + 500),
        b"a": (metrics_record(step=7, loss=6.0, mini_steps=2, samples=32, sps=10.0), NOW + 500),
        b"b": (metrics_record(step=6, loss=4.0, mini_steps=2, samples=32, sps=10.0), NOW + 500),
    }
    metrics = aggregate(records, NOW, step_lag=2)
    assert (metrics.step, metrics.alive_peers, metrics.samples, metrics.samples_per_second) == (7, 2, 64, 20.0)
    assert metrics.loss == pytest.approx(10.0 / 4)
    assert aggregate(records, NOW, step_lag=3).alive_peers == 3  # 4 >= 7 - 3: still counted
    assert aggregate(records, NOW, step_lag=0).alive_peers == 1  # only the newest step


def test_peers_that_left_stop_holding_the_step_once_their_progress_records_expire():
    # the fault drill: peer 1 killed at step 4, peer 2 stopped at 8 and back under a new key; the two running peers
    # at 11 were taken for liars by the median of four records, and the monitor reported nothing for minutes
    records = {
        b"killed": (metrics_record(step=4), NOW + 500),
        b"stopped": (metrics_record(step=8), NOW + 500),
        b"running": (metrics_record(step=11), NOW + 500),
        b"restarted": (metrics_record(step=11), NOW + 500),
    }
    alive = live_metrics(records, NOW)
    assert summarize(alive, NOW, step_lag=2).step == 8
    live = with_live_progress(alive, {b"running", b"restarted", b"no metrics yet"})
    assert sorted(live) == [b"restarted", b"running"]
    assert (summarize(live, NOW, step_lag=2).step, summarize(live, NOW, step_lag=2).alive_peers) == (11, 2)
    # no progress record in sight (none readable, or all expired): the metrics records alone, as before
    assert with_live_progress(alive, set()) == alive
    assert with_live_progress(alive, {b"someone else"}) == alive


def test_each_peer_counts_once():
    # the DHT keys records by the peer's public key: a peer that publishes again replaces its own record
    records = {b"a": (metrics_record(step=1), NOW + 10)}
    records[b"a"] = (metrics_record(step=2), NOW + 20)
    assert aggregate(records, NOW).alive_peers == 1


@pytest.mark.parametrize(
    ("steps", "step_lag", "expected"),
    [
        ([7], 2, 7),
        ([6, 7], 2, 7),  # in sync: the newest step
        ([5, 6, 7, 7], 2, 7),
        ([6, 7, 2**39], 2, 7),  # one liar far ahead
        ([7, 2**39], 2, 7),  # one against one: the lower one
        ([7, 7, 2**39, 2**39], 2, 7),  # half are liars: still the lower half
        ([7, 7, 7, 2**39, 2**39], 2, 7),
        ([7, 7, 9], 2, 9),  # ahead within step_lag: an honest peer one epoch early looks the same
        ([7, 7, 10], 2, 7),
        ([0, 0, 7, 7, 7], 2, 7),  # behind: dead peers or liars, a minority either way
        ([4, 4, 7], 2, 4),  # most peers left: their step until their records expire
        ([3, 3], 0, 3),
    ],
)
def test_the_step_is_the_honest_majority_s(steps, step_lag, expected):
    assert honest_step(steps, step_lag) == expected
    assert honest_step(list(reversed(steps)), step_lag) == expected


def test_liars_far_ahead_move_neither_the_step_nor_the_sums():
    honest = {
        b"a": (metrics_record(step=7, loss=6.0, mini_steps=2, samples=32, sps=10.0), NOW + 500),
        b"b": (metrics_record(step=6, loss=4.0, mini_steps=2, samples=32, sps=10.0), NOW + 500),
        b"c": (metrics_record(step=7, loss=2.0, mini_steps=2, samples=32, sps=10.0), NOW + 500),
    }
    liars = {
        b"liar": (metrics_record(step=2**39, loss=1e6, mini_steps=1, samples=2**39, sps=1e7), NOW + 500),
        b"liar2": (metrics_record(step=10, loss=0.0, mini_steps=10**7, samples=1, sps=1e7), NOW + 500),
    }
    expected = aggregate(honest, NOW, step_lag=2)
    assert (expected.step, expected.alive_peers, expected.samples, expected.samples_per_second) == (7, 3, 96, 30.0)
    assert aggregate({**honest, **liars}, NOW, step_lag=2) == expected
    alive = live_metrics({**honest, **liars}, NOW)
    assert sorted(far_ahead(alive, expected.step)) == [b"liar", b"liar2"]


@pytest.mark.parametrize(
    "bad",
    [
        metrics_record(loss=math.nan),
        metrics_record(loss=math.inf),
        metrics_record(sps=-1.0),
        {**metrics_record(), "extra": 1},
        {"step": "7"},
        None,
        [1, 2],
        "garbage",
    ],
)
def test_malformed_and_non_finite_records_are_ignored(bad):
    metrics = aggregate({b"good": (metrics_record(step=2), NOW + 10), b"bad": (bad, NOW + 10)}, NOW)
    assert (metrics.alive_peers, metrics.step, metrics.loss) == (1, 2, 2.0)


def test_malformed_expiration_is_ignored():
    assert (
        aggregate({b"a": (metrics_record(), None), b"b": "not a pair", b"c": (metrics_record(), "soon")}, NOW) is None
    )


def test_console_line_format():
    line = format_line(
        aggregate(
            {b"a": (metrics_record(step=12, loss=13.648, mini_steps=4, samples=1024, sps=88.1), NOW + 1)}, NOW
        ).to_dict()
    )
    assert line == "step 12  loss 3.412  peers 1  samples 1024  samples/s 88.1"


values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-10, 10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
    st.lists(st.integers(), max_size=2),
)
records = st.one_of(
    st.fixed_dictionaries(
        {
            "step": values,
            "samples_per_second": values,
            "samples_accumulated": values,
            "loss": values,
            "mini_steps": values,
        }
    ),
    st.dictionaries(st.text(max_size=12), values, max_size=6),
    values,
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.binary(min_size=1, max_size=8),
        st.tuples(records, st.one_of(st.floats(allow_nan=True), st.integers(), st.none())),
        max_size=8,
    )
)
def test_any_records_never_crash_and_only_valid_ones_count(raw):
    metrics = aggregate(raw, NOW, step_lag=2)
    if metrics is None:
        return
    counted = [m for m in live_metrics(raw, NOW).values() if metrics.step - 2 <= m.step <= metrics.step]
    assert metrics.alive_peers == len(counted) and metrics.samples == sum(m.samples_accumulated for m in counted)
    assert 1 <= metrics.alive_peers <= len(raw)
    assert metrics.step >= 0 and metrics.samples >= 0
    assert math.isfinite(metrics.samples_per_second) and metrics.samples_per_second >= 0
    assert metrics.loss is None or (math.isfinite(metrics.loss) and metrics.loss >= 0)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(2, 10**6),
    st.integers(1, 6),
    st.lists(st.integers(0, MAX_STEP), max_size=6),
)
def test_as_many_liars_far_ahead_as_honest_peers_change_nothing(top, honest_peers, liar_steps):
    honest = {
        f"h{i}".encode(): (metrics_record(step=top - i % 3), NOW + 60) for i in range(honest_peers)
    }  # 2 epochs apart
    liars = {
        f"l{i}".encode(): (
            metrics_record(step=max(step, top + 3), loss=1e6, mini_steps=1, samples=2**39, sps=1e7),
            NOW + 60,
        )
        for i, step in enumerate(liar_steps[:honest_peers])
    }
    assert aggregate({**honest, **liars}, NOW, step_lag=2) == aggregate(honest, NOW, step_lag=2)


def contributed(step: int, samples: int, epochs: int, name: str | None = None) -> dict:
    """A record of a peer that has published ``epochs`` epochs with ``samples`` samples in all."""
    record = {**metrics_record(step=step), "contributed_samples": samples, "contributed_epochs": epochs}
    return record if name is None else {**record, "public_name": name}


def refreshes(*reads: tuple[float, dict]) -> dict:
    """What the monitor remembers after reading these records at these times, as monitor/run.py's refresh does."""
    seen: dict = {}
    for now, records in reads:
        alive = live_metrics({peer: (value, now + 60) for peer, value in records.items()}, now)
        seen = count_contributions(seen, alive, summarize(alive, now, 2).step, now)
    return seen


def test_contributions_are_each_peers_newest_totals_with_the_time_between_its_first_and_last_record():
    seen = refreshes(
        (100.0, {b"alice-key": contributed(3, 300, 3, "alice"), b"b-key": contributed(3, 64, 1)}),
        (110.0, {b"alice-key": contributed(4, 364, 4, "alice"), b"b-key": contributed(3, 64, 1)}),
        (125.0, {b"alice-key": contributed(5, 428, 5, "alice"), b"b-key": contributed(3, 64, 1)}),
    )
    assert top_contributors(seen) == [
        {"peer": "72ee9d4355cc", "name": "alice", "samples": 428, "rounds": 5, "seconds_online": 25.0,
         "last_seen": 125.0},
        {"peer": "912cf63e4e97", "name": None, "samples": 64, "rounds": 1, "seconds_online": 0.0, "last_seen": 100.0},
    ]  # fmt: skip


def test_a_peer_that_stopped_publishing_keeps_its_contribution_but_not_its_time_online():
    # b's record outlives b for minutes: seeing it again is not b being online
    first = (100.0, {b"a": contributed(3, 96, 3), b"b": contributed(3, 640, 10)})
    later = [
        (100.0 + 10 * i, {b"a": contributed(3 + i, 96 + 32 * i, 3 + i), b"b": contributed(3, 640, 10)}) for i in (1, 2)
    ]
    by_peer = {row["samples"]: row for row in top_contributors(refreshes(first, *later))}
    assert (by_peer[640]["rounds"], by_peer[640]["seconds_online"], by_peer[640]["last_seen"]) == (10, 0.0, 100.0)
    assert (by_peer[160]["rounds"], by_peer[160]["seconds_online"], by_peer[160]["last_seen"]) == (5, 20.0, 120.0)
    gone = refreshes(first, (200.0, {b"a": contributed(9, 300, 9)}))  # b's record expired: b is still listed
    assert [(row["samples"], row["rounds"]) for row in top_contributors(gone)] == [(640, 10), (300, 9)]


def test_a_liar_far_ahead_or_a_record_going_back_counts_nothing():
    honest = {b"a": contributed(7, 100, 7), b"b": contributed(7, 100, 7)}
    seen = refreshes((100.0, {**honest, b"liar": contributed(2**39, 10**15, 2**39, "liar")}))
    assert [row["samples"] for row in top_contributors(seen)] == [100, 100]
    back = refreshes((100.0, honest), (110.0, {**honest, b"a": contributed(6, 5000, 9, "renamed")}))
    assert {(row["name"], row["samples"], row["last_seen"]) for row in top_contributors(back)} == {(None, 100, 100.0)}


@pytest.mark.parametrize(
    "name",
    ["x" * 33, "line\nbreak", "\x1b[2J\x1b[31mred", "right\u202eto left", "", " padded", "x" * 10**6, 42, ["a"]],
)
def test_a_record_with_a_long_or_unprintable_name_is_rejected_whole(name):
    hostile = {**contributed(3, 10**6, 3), "public_name": name}
    seen = refreshes((100.0, {b"a": contributed(3, 96, 3, "ok"), b"hostile": hostile}))
    assert [(row["name"], row["samples"]) for row in top_contributors(seen)] == [("ok", 96)]
    assert aggregate({b"a": (contributed(3, 96, 3), NOW + 1), b"h": (hostile, NOW + 1)}, NOW).alive_peers == 1


def test_names_at_the_bounds_are_kept_as_they_are():
    for name in ("y" * 32, "Zoë 🙂 <b>&amp;</b>", "a"):
        [row] = top_contributors(refreshes((100.0, {b"a": contributed(3, 96, 3, name)})))
        assert row["name"] == name


def test_a_record_from_an_older_peer_counts_as_contributing_nothing():
    [row] = top_contributors(refreshes((100.0, {b"old": metrics_record(step=3)})))
    assert (row["name"], row["samples"], row["rounds"]) == (None, 0, 0)


def test_the_report_holds_the_most_samples_and_the_memory_the_most_recently_seen():
    seen = refreshes(*[(100.0 + i, {f"p{i:03d}".encode(): contributed(5, 1000 - i, 5)}) for i in range(150)])
    report = top_contributors(seen, limit=100)
    assert [row["samples"] for row in report] == list(range(1000, 900, -1))
    ties = top_contributors(refreshes((1.0, {b"x": contributed(5, 7, 2), b"y": contributed(5, 7, 3)})))
    assert [row["rounds"] for row in ties] == [3, 2]
    alive = live_metrics({f"p{i}".encode(): (contributed(5, i, 5), 200.0) for i in range(5)}, 100.0)
    remembered = count_contributions(seen, alive, 5, now=300.0, limit=40)
    assert len(remembered) == 40 and all(remembered[f"p{i}".encode()].last_seen == 300.0 for i in range(5))
    assert min(c.last_seen for c in remembered.values()) == 100.0 + 150 - 35  # the 35 newest of the 150 remain
