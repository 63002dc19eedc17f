"""collab.dht.keep_rejoining: a node that lost its peers (what a network cut leaves) finds them again.

hivemind drops a peer from the routing table after one unanswered request and never looks for it again; the
two real DHT nodes here lose each other the same way (their tables emptied), and only the rejoining pair comes
back. tests/integration/test_partition.py cuts a real link between two trainers for the end-to-end case.
"""

import contextlib
import time

import pytest
from hivemind.utils import get_dht_time

from collab.dht import keep_rejoining, plan_rejoin
from tests.local_dht import two_dhts
from trainer.local import wait_until

PERIOD = 0.5  # seconds between rejoin rounds in these tests (10 s in a peer)


def test_a_lost_peer_is_pinged_most_recently_seen_first_and_forgotten_after_a_while():
    seen = {"a": 90.0, "b": 99.0, "c": 10.0, "d": 95.0}
    seen, lost = plan_rejoin(seen, present=["d"], initial_peers=[], now=100.0, remember_for=60.0)
    assert lost == ["b", "a"]
    assert seen == {"a": 90.0, "b": 99.0, "d": 100.0}


def test_only_an_isolated_node_pings_its_initial_peers_however_old():
    _, lost = plan_rejoin({}, present=[], initial_peers=["boot", "boot"], now=1e6)
    assert lost == ["boot"]
    _, lost = plan_rejoin({}, present=["x"], initial_peers=["boot"], now=1e6)
    assert lost == []


def test_pings_per_round_are_capped():
    seen = {f"p{i}": float(i) for i in range(40)}
    _, lost = plan_rejoin(seen, present=[], initial_peers=[], now=40.0, max_pings=16)
    assert lost == [f"p{i}" for i in range(39, 23, -1)]


async def _table(_dht, node) -> list[str]:
    return [str(peer) for peer in node.protocol.routing_table.peer_id_to_uid]


async def _forget_everyone(_dht, node) -> None:
    table = node.protocol.routing_table
    for uid in list(table.uid_to_peer_id):
        del table[uid]


@contextlib.contextmanager
def pair(rejoin: bool):
    with two_dhts() as (first, second):
        if rejoin:  # as start_dht does: the joiner also knows its initial peer, the first node knows nobody yet
            keep_rejoining(first, period=PERIOD)
            keep_rejoining(second, [str(maddr) for maddr in first.get_visible_maddrs()], period=PERIOD)
        wait_until(lambda: all(node.run_coroutine(_table) for node in (first, second)), 30, "the pair to meet")
        for node in (first, second):
            node.run_coroutine(_forget_everyone)
        yield first, second


@pytest.mark.upstream
def test_plain_hivemind_nodes_that_lost_each_other_stay_apart():
    with pair(rejoin=False) as (first, second):
        deadline = time.monotonic() + 6 * PERIOD
        while time.monotonic() < deadline:  # six rejoin rounds' worth of time, checked throughout
            assert first.run_coroutine(_table) == [] and second.run_coroutine(_table) == []
            time.sleep(0.1)
        first.store("epoch", 7, get_dht_time() + 60)
        assert second.get("epoch", latest=True) is None


@pytest.mark.timeout(120)
def test_rejoining_nodes_find_each_other_again_and_share_records():
    with pair(rejoin=True) as (first, second):
        wait_until(
            lambda: (
                first.run_coroutine(_table) == [str(second.peer_id)]
                and second.run_coroutine(_table) == [str(first.peer_id)]
            ),
            30,
            "both routing tables to hold the other node again",
        )
        first.store("epoch", 7, get_dht_time() + 60)
        found = second.get("epoch", latest=True)
        assert found is not None and found.value == 7
