"""The Contributors table: posted by the monitor with each step, stored apart and bounded, shown escaped."""

from __future__ import annotations

import pytest

from collab.schema import MAX_CONTRIBUTED_SAMPLES, MAX_STEP
from tests.web.helpers import bearer

pytestmark = pytest.mark.light

SCRIPT_NAME = "<script>alert(1)</script>"


def contributor(peer: str = "0123456789ab", **extra) -> dict:
    return {
        "peer": peer,
        "name": None,
        "samples": 640,
        "rounds": 5,
        "seconds_online": 3725.0,
        "last_seen": 1_700_000_000.0,
        **extra,
    }


def step(number: int, contributors: list[dict] | None = None) -> dict:
    record = {
        "step": number,
        "loss": 4.0,
        "alive_peers": 2,
        "samples": 128,
        "samples_per_second": 40.5,
        "time": 1_700_000_000.0 + number,
    }
    return record if contributors is None else {**record, "contributors": contributors}


def post(client, experiment, record):
    return client.post("/api/experiments/1/metrics", json=record, headers=bearer(experiment["monitor_token"]))


def test_contributors_are_kept_apart_from_the_steps_and_the_newest_list_wins(client, experiment):
    assert client.get("/api/experiments/1/contributors").json() == {"step": None, "contributors": []}
    first = [contributor(name="alice"), contributor("fedcba987654")]
    response = post(client, experiment, step(3, first))
    assert response.status_code == 200 and "contributors" not in response.json()
    assert client.get("/api/experiments/1/contributors").json() == {"step": 3, "contributors": first}
    assert "contributors" not in client.get("/api/experiments/1/metrics").json()[0]
    assert post(client, experiment, step(2, [contributor(samples=1)])).status_code == 200  # a late retry
    assert post(client, experiment, step(4)).status_code == 200  # an older monitor: no list
    assert client.get("/api/experiments/1/contributors").json() == {"step": 3, "contributors": first}
    newer = [contributor(name="alice", samples=700, rounds=6)]
    post(client, experiment, step(5, newer))
    assert client.get("/api/experiments/1/contributors").json() == {"step": 5, "contributors": newer}
    assert client.get("/api/experiments/2/contributors").status_code == 404


def test_values_at_the_bounds_of_a_peers_record_are_accepted(client, experiment):
    # the monitor passes on whatever a valid record claims: refusing it here would drop the whole step
    extreme = contributor(name="n" * 32, samples=MAX_CONTRIBUTED_SAMPLES, rounds=MAX_STEP)
    assert post(client, experiment, step(1, [extreme] * 100)).status_code == 200


@pytest.mark.parametrize(
    ("change", "loc"),
    [
        ({"name": "x" * 33}, ["name"]),
        ({"name": "\x1b[2Jcleared"}, ["name"]),
        ({"name": "two\nlines"}, ["name"]),
        ({"name": "right\u202eleft"}, ["name"]),
        ({"name": ""}, ["name"]),
        ({"peer": "not-a-hash!!"}, ["peer"]),
        ({"peer": "0123456789abcdef"}, ["peer"]),
        ({"samples": MAX_CONTRIBUTED_SAMPLES + 1}, ["samples"]),
        ({"samples": -1}, ["samples"]),
        ({"rounds": 1.5}, ["rounds"]),
        ({"seconds_online": -1.0}, ["seconds_online"]),
        ({"extra": 1}, ["extra"]),
    ],
)
def test_a_bad_contributor_is_422_naming_it_and_stores_nothing(client, experiment, change, loc):
    response = post(client, experiment, step(1, [contributor(), contributor(**change)]))
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"][:3] == ["body", "contributors", 1]
    assert response.json()["detail"][0]["loc"][3:4] == loc
    assert client.get("/api/experiments/1/metrics").json() == []
    assert client.get("/api/experiments/1/contributors").json()["contributors"] == []


def test_more_than_a_hundred_contributors_is_422(client, experiment):
    response = post(client, experiment, step(1, [contributor()] * 101))
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", "contributors"]


def test_the_page_shows_the_table_with_every_name_escaped(client, experiment):
    assert 'id="no-contributors">' in client.get("/experiments/1").text  # shown: nothing reported yet
    post(client, experiment, step(1, [contributor(name=SCRIPT_NAME, samples=900), contributor("fedcba987654")]))
    page = client.get("/experiments/1").text
    assert "<script>alert(1)</script>" not in page
    assert "<td>&lt;script&gt;alert(1)&lt;/script&gt;</td><td><code>0123456789ab</code></td><td>900</td>" in page
    assert "<td>fedcba987654</td><td><code>fedcba987654</code></td><td>640</td><td>5</td>" in page  # no name: key
    assert "<td>1 h 2 min</td><td>2023-11-14 22:13:20 UTC</td>" in page
    assert 'id="no-contributors" hidden>' in page
