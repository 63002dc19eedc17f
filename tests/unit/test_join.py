"""bench.join's pure parts: its flags' bounds and which round counts as the newcomer's first own one."""

from __future__ import annotations

import pytest

from bench.join import first_own_round, loads_until_loaded, main

pytestmark = pytest.mark.light


@pytest.mark.parametrize("flags", [["--mbit", "0"], ["--layers", "49"], ["--minutes", "0.5"]])
def test_a_flag_out_of_bounds_stops_the_run_before_anything_starts(flags, capsys, tmp_path):
    with pytest.raises(SystemExit) as stopped:
        main([*flags, "--log_dir", str(tmp_path / "logs")])
    assert stopped.value.code == 2
    assert "--mbit must be in (0, 10000]" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()


def test_the_first_own_round_takes_samples_with_a_groupmate():
    def averaged(time, kind, weight, group_size):
        return {"time": time, "event": "averaged", "kind": kind, "weight": weight, "group_size": group_size}

    events = [
        {"time": 1.0, "event": "state_loaded"},
        averaged(2.0, "gradients", 0, 2),  # catching up: weight 0
        averaged(3.0, "parameters", 1, 2),
        averaged(4.0, "gradients", 64, 1),  # alone
        averaged(5.0, "gradients", 64, 2),
        averaged(6.0, "gradients", 64, 2),
    ]
    assert first_own_round(events)["time"] == 5.0
    assert first_own_round(events[:4]) is None


def test_tries_until_the_state_is_loaded_count_the_loads_that_applied_none():
    events = [
        {"time": 1.0, "event": "joined"},
        {"time": 230.0, "event": "state_not_loaded", "tries": 1, "reason": "download failed"},
        {"time": 460.0, "event": "state_loaded", "tries": 2},
        {"time": 900.0, "event": "state_not_loaded", "tries": 1, "reason": "no donor"},  # later: not this join's
    ]
    loads = loads_until_loaded(events)
    assert [record["time"] for record in loads] == [230.0, 460.0]
    assert sum(record["tries"] for record in loads) == 3
