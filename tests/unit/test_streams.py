"""bench.streams: p2pd daemons in network namespaces exchange bytes on fresh streams, and each outcome is counted."""

from __future__ import annotations

import os
import shutil

import pytest

from bench.streams import outcome, parse_args, summarize


def exchange(sent: int, received: int, **extra) -> dict:
    return {"event": "exchange", "sent": sent, "received": received, "seconds": 1.0, **extra}


def test_a_stream_that_ends_short_without_an_error_is_a_silent_end():
    assert outcome(exchange(100, 100)) == "ok"
    assert outcome(exchange(100, 40)) == "silent_end"
    assert outcome(exchange(100, 0)) == "silent_end"
    assert outcome(exchange(100, 40, error="ConnectionResetError(104)")) == "error"
    assert outcome(exchange(100, 0, timed_out=True)) == "timeout"


def test_the_summary_counts_each_outcome_and_times_only_the_exchanges_that_ended():
    records = [exchange(10, 10, seconds=2.0), exchange(10, 10, seconds=4.0), exchange(10, 3, seconds=9.0)]
    records.append({"event": "exchange", "sent": 10, "received": 0, "timed_out": True})
    summary = summarize(records)
    assert summary == {
        "exchanges": 4,
        "ok": 2,
        "silent_end": 1,
        "error": 0,
        "timeout": 1,
        "seconds_median": 4.0,
        "seconds_max": 9.0,
    }
    assert summarize([])["seconds_median"] is None


def test_flags_out_of_bounds_are_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--peers", "1"])
    assert "--peers must be 2 to 16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--rate_mbit", "0"])
    assert "--rate_mbit must be" in capsys.readouterr().err


@pytest.mark.timeout(120)
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="network namespaces need root and `ip`")
def test_peers_in_namespaces_get_every_byte_back_on_a_fast_link(tmp_path):
    """Three real p2pd daemons, each in its namespace at 20 Mbit/s: two rounds of 100 kB each way to each other peer
    all come back whole, and the kernel counts the segments of every namespace with no connection reset."""
    from bench.streams import measure

    figures = measure(parse_args(["--rate_mbit", "20", "--rounds", "2", "--bytes", "100000"]), tmp_path)
    assert figures["exit_codes"] == [0, 0, 0]
    assert (figures["exchanges"], figures["ok"]) == (12, 12), figures
    # each peer sent its own 2 x 2 x 100 kB at least: about 70 full segments each way of each exchange
    assert all(counts["sent_segments"] > 200 for counts in figures["tcp"]), figures["tcp"]
    assert [counts["established_resets"] for counts in figures["tcp"]] == [0, 0, 0], figures["tcp"]
    assert figures["congestion_control"]
