"""collab.dht's start-up report: whether other peers can reach this one and through what, and what it found under
the experiment's prefix. tests/integration/test_relay.py runs it behind a namespace that drops inbound connections.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import hivemind
import pytest
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from arguments import PeerArguments
from collab import events
from collab.dht import (
    Reachability,
    RelayedDHT,
    RelayWatch,
    StaticRelaysP2P,
    address_kind,
    count_peers_under_prefix,
    dht_bootstrapped_within,
    joined_fields,
    listens_at_a_public_address,
    reachability,
    reachability_line,
    relay_wait_over,
    relays_in,
    start_dht,
    watch_relays,
)
from collab.errors import ConfigError
from collab.hivemind_fixes import progress_key
from tests.local_dht import two_dhts
from trainer.local import free_port, wait_until

PEER = "/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
RELAY_A = "QmaDsctAS7MZgP9gbGEe9Yqb9JiHeivRcuVByEeBdij8gt"
RELAY_B = "12D3KooWMRNjutnEHrYcqfCWt9UvLonkk7rpMnv7xFxsPA64uEtE"


def through(relay: str, host: str = "11.0.0.1") -> str:
    """This peer's address through ``relay``, as libp2p announces it."""
    return f"/ip4/{host}/tcp/5/p2p/{relay}/p2p-circuit" + PEER


@pytest.mark.parametrize(
    ("maddr", "kind"),
    [
        ("/ip4/127.0.0.1/tcp/5" + PEER, "loopback"),
        ("/ip6/::1/tcp/5" + PEER, "loopback"),
        ("/ip4/10.1.2.3/tcp/5" + PEER, "private"),
        ("/ip4/192.168.0.7/tcp/5" + PEER, "private"),
        ("/ip4/100.64.0.1/tcp/5" + PEER, "private"),  # carrier-grade NAT
        ("/ip4/8.8.8.8/tcp/5" + PEER, "public"),
        ("/dns4/example.org/tcp/5" + PEER, "public"),
        ("/ip4/8.8.8.8/tcp/5" + PEER + "/p2p-circuit" + PEER, "relay"),
        ("/ip4/not-an-ip/tcp/5", "private"),
    ],
)
def test_address_kind(maddr, kind):
    assert address_kind(maddr) == kind


def test_the_best_kind_of_address_says_how_a_peer_is_reached():
    local, lan = "/ip4/127.0.0.1/tcp/5" + PEER, "/ip4/10.0.0.2/tcp/5" + PEER
    relayed = "/ip4/10.0.0.1/tcp/6" + PEER + "/p2p-circuit" + PEER
    assert reachability([local, lan], client_mode=False) == Reachability(True, "private", (local, lan))
    assert reachability([local, relayed, lan], client_mode=False).via == "relay"
    assert reachability([local], client_mode=False).via == "loopback"
    assert reachability([local, lan], client_mode=True) == Reachability(False, "client_mode")
    assert reachability([], client_mode=False) == Reachability(False, "none")


def test_the_line_names_the_join_flag_only_when_reachable():
    lan = "/ip4/10.0.0.2/tcp/5" + PEER
    line = reachability_line(Reachability(True, "private", (lan,)), True, "demo", 3)
    assert line.endswith("--initial_peers " + lan) and "3 peer(s)" in line
    line = reachability_line(Reachability(False, "client_mode"), False, "demo", -1)
    assert "--initial_peers" not in line and "--experiment_prefix demo" in line and "off" in line


def test_the_line_says_when_a_relay_was_asked_for_and_none_reserved():
    lan = "/ip4/10.0.0.5/tcp/31337" + PEER
    line = reachability_line(Reachability(True, "private", (lan,)), True, "demo", 3, asked_for_relay=True)
    assert "--use_auto_relay: no relay slot" in line and "public address" in line
    relayed = Reachability(True, "relay", ("/ip4/11.0.0.1/tcp/5" + PEER + "/p2p-circuit" + PEER,))
    assert "no relay slot" not in reachability_line(relayed, True, "demo", 3, asked_for_relay=True)
    assert "no relay slot" not in reachability_line(Reachability(True, "private", (lan,)), True, "demo", 3)


def test_a_relayed_peer_with_a_single_relay_is_told_to_name_more():
    one = reachability_line(Reachability(True, "relay", (through(RELAY_A),)), True, "demo", 3, asked_for_relay=True)
    assert "one relay: if it leaves, this peer is unreachable" in one and "two or more --initial_peers" in one
    # two addresses through one relay (TCP and QUIC, say) are still one relay
    same = Reachability(True, "relay", (through(RELAY_A), through(RELAY_A, "11.0.0.9")))
    assert "one relay" in reachability_line(same, True, "demo", 3, asked_for_relay=True)
    two = Reachability(True, "relay", (through(RELAY_A), through(RELAY_B)))
    assert "one relay" not in reachability_line(two, True, "demo", 3, asked_for_relay=True)


def test_a_relayed_peer_waits_for_a_slot_on_each_relay_it_asked_for_a_few_seconds_at_most():
    # (relays held, relays asked, seconds since the first slot, seconds waited, timeout)
    assert relay_wait_over(2, 2, 0.0, 1.0, 15) and relay_wait_over(1, 1, 0.0, 1.0, 15)
    assert not relay_wait_over(1, 2, 1.0, 2.0, 15)  # the second relay's slot may come a moment later
    assert relay_wait_over(1, 2, 3.0, 4.0, 15)  # the other initial peer may not relay at all
    assert not relay_wait_over(0, 2, 0.0, 14.0, 15) and relay_wait_over(0, 2, 0.0, 15.0, 15)


def test_the_relays_of_a_peer_are_read_from_its_circuit_addresses():
    lan = "/ip4/10.0.0.2/tcp/5" + PEER
    addresses = [lan, through(RELAY_B), through(RELAY_A), through(RELAY_B, "11.0.0.2")]
    assert relays_in(addresses) == (RELAY_B, RELAY_A)  # each once, sorted
    assert relays_in([lan, "/ip4/11.0.0.1/tcp/5/p2p-circuit" + PEER]) == ()  # a circuit through no named relay


def test_a_relay_lost_or_gained_is_one_event_and_one_line(tmp_path, caplog):
    path = tmp_path / "events.jsonl"
    events.open_event_log(path)
    try:
        watch = RelayWatch((RELAY_A, RELAY_B))
        with caplog.at_level(logging.INFO, logger="collab.dht"):
            watch.check([through(RELAY_A), through(RELAY_B)])  # no change: nothing said
            watch.check([through(RELAY_B)])
            watch.check([through(RELAY_B)])
            watch.check(["/ip4/10.0.0.2/tcp/5" + PEER])
            watch.check([through(RELAY_A)])
    finally:
        events.open_event_log(None)
    assert [{k: r[k] for k in ("relays", "lost", "gained")} for r in read(path)] == [
        {"relays": [RELAY_B], "lost": [RELAY_A], "gained": []},
        {"relays": [], "lost": [RELAY_B], "gained": []},
        {"relays": [RELAY_A], "lost": [], "gained": [RELAY_A]},
    ]
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in lines] == [logging.INFO, logging.WARNING, logging.INFO]
    assert lines[0][1] == f"Reachable through 1 relay(s) now (lost {RELAY_A})"
    assert lines[1][1].startswith(f"Not reachable any more: no relay holds a slot for this peer (lost {RELAY_B})")
    assert "two or more --initial_peers running --use_relay" in lines[1][1]


def read(path: Path) -> list[dict]:
    return events.read_events(path, "relays_changed")


def test_a_real_dht_reports_a_relay_its_addresses_no_longer_go_through(tmp_path):
    """The watch runs in the DHT's own process: a node that was (as told here) reached through a relay, and whose
    real addresses go through none, writes the event from there."""
    path = tmp_path / "events.jsonl"
    events.open_event_log(path)  # before the DHT's process forks, which then writes to it
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        watch_relays(dht, [through(RELAY_A)], period=0.2)
        wait_until(lambda: read(path), 20, "the DHT's relays_changed event")
        time.sleep(1.0)  # five more reads of the same addresses
    finally:
        dht.shutdown()
        events.open_event_log(None)
    records = read(path)
    assert len(records) == 1, records  # once: the loop does not repeat a change it reported
    assert records[0]["relays"] == [] and records[0]["lost"] == [RELAY_A] and records[0]["gained"] == []


def test_a_peer_listening_at_or_announcing_an_internet_address_is_public():
    def public(host: str, announce: tuple[str, ...] = ()) -> bool:
        return listens_at_a_public_address(PeerArguments(host_maddrs=[host], announce_maddrs=list(announce)))

    assert public("/ip4/11.77.0.1/tcp/0") and public("/ip4/0.0.0.0/tcp/31337", ("/ip4/1.2.3.4/tcp/31337",))
    assert public("/dns4/relay.example.org/tcp/31337")
    # a LAN address, any address (0.0.0.0: which one others see is not known) and loopback are not
    assert not any(public(f"/ip4/{host}/tcp/0") for host in ("10.0.0.5", "0.0.0.0", "127.0.0.1"))


def test_relay_flags_are_checked():
    with pytest.raises(ConfigError, match="use_auto_relay"):
        PeerArguments(use_auto_relay=True)  # no relay to reserve a slot on
    with pytest.raises(ConfigError, match="use_auto_relay"):
        PeerArguments(use_auto_relay=True, use_relay=False, initial_peers=["/ip4/10.0.0.1/tcp/5" + PEER])
    with pytest.raises(ConfigError, match="use_auto_relay"):
        PeerArguments(use_auto_relay=True, client_mode=True, initial_peers=["/ip4/10.0.0.1/tcp/5" + PEER])
    assert PeerArguments().use_relay  # hivemind's own default: every peer accepts relayed connections


def test_peers_under_the_prefix_are_counted_on_a_real_dht():
    with two_dhts() as (first, second):
        assert count_peers_under_prefix(second, "reachtest", timeout=10) == -1
        for name in (b"a", b"b"):
            first.store(progress_key("reachtest"), {"epoch": 0}, get_dht_time() + 60, subkey=name)
        assert count_peers_under_prefix(second, "reachtest", timeout=10) == 2
        assert count_peers_under_prefix(second, "otherprefix", timeout=10) == -1


def test_a_started_node_reports_its_loopback_address_in_the_joined_fields():
    dht = start_dht(PeerArguments(experiment_prefix="reachtest"))
    try:
        fields = joined_fields(dht, client_mode=False)
        assert fields["reachable"] is True and fields["reached_via"] == "loopback"
        assert fields["address"] and all(a.startswith("/ip4/127.0.0.1/tcp/") for a in fields["address"])
        assert joined_fields(dht, client_mode=True)["reachable"] is False
    finally:
        dht.shutdown()


def test_a_relayed_peer_takes_its_initial_peers_as_static_relays():
    initial = ["/ip4/10.0.0.1/tcp/5" + PEER]
    args = StaticRelaysP2P._make_process_args("p2pd", autoRelay=True, relay=True, trustedRelays=",".join(initial))
    assert "-relayDiscovery=0" in args and f"-trustedRelays={initial[0]}" in args
    # without trusted relays p2pd refuses discovery off; without auto-relay it takes no relays at all
    assert not any(a.startswith("-relayDiscovery") for a in StaticRelaysP2P._make_process_args("p2pd", autoRelay=True))
    assert "-relayDiscovery=0" not in StaticRelaysP2P._make_process_args("p2pd", autoRelay=False, trustedRelays="x")


def child_commands(pid: int) -> list[list[bytes]]:
    """The command lines of the processes whose parent is ``pid``."""
    commands = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if parent == pid:
                commands.append((stat.parent / "cmdline").read_bytes().split(b"\0"))
        except (OSError, ValueError, IndexError):
            continue  # a process that ended meanwhile
    return commands


def test_a_relayed_dht_starts_its_daemon_with_static_relays_in_its_own_process_only():
    """A real p2pd under those flags (it exits on flags it cannot take together) joins the relay it was given."""
    with two_dhts() as (first, _):
        initial = [str(maddr) for maddr in first.get_visible_maddrs()]
        dht = dht_bootstrapped_within(  # as start_dht builds it: a CI run's p2pd once reached no initial peer
            RelayedDHT,
            15.0,
            start=True,
            initial_peers=initial,
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            use_auto_relay=True,
            force_reachability="private",
            trusted_relays=initial,
        )
        try:
            daemons = [c for c in child_commands(dht.pid) if any(b"-trustedRelays=" in arg for arg in c)]
            assert len(daemons) == 1 and b"-relayDiscovery=0" in daemons[0]
            assert hivemind.dht.node.P2P is P2P  # this process's hivemind is as it was
            first.store("relayed_key", 1, get_dht_time() + 60)
            assert dht.get("relayed_key", latest=True).value == 1
        finally:
            dht.shutdown()


class OnFirstRecord(logging.Handler):
    """Runs ``action`` in a thread of its own at the first record whose message holds ``text``."""

    def __init__(self, text: str, action):
        super().__init__()
        self.text, self.thread = text, threading.Thread(target=action)

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage() and self.thread.ident is None:
            self.thread.start()


def test_a_peer_whose_initial_peer_starts_a_moment_later_joins_it_within_the_bootstrap_timeout(tmp_path):
    """p2pd tries each initial peer once: an initial peer that is not up yet (restarting, or its machine stalled)
    ended a peer's start at once whatever --bootstrap_timeout said. The start is tried again until that timeout: the
    initial peer comes back (same identity and port) only once the first try has failed, and the peer joins it."""
    key, port = tmp_path / "first.key", free_port()
    options = dict(start=True, host_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"], identity_path=str(key))
    first = hivemind.DHT(**options)
    initial = [str(maddr) for maddr in first.get_visible_maddrs()]
    first.shutdown()
    restarted: list[hivemind.DHT] = []
    comeback = OnFirstRecord("No initial peer answered", lambda: restarted.append(hivemind.DHT(**options)))
    dht_logger = logging.getLogger("collab.dht")
    dht_logger.addHandler(comeback)
    try:
        dht = start_dht(PeerArguments(experiment_prefix="bootstrap_retry", initial_peers=initial))
        try:
            comeback.thread.join(timeout=30)
            restarted[0].store("retried_key", 1, get_dht_time() + 60)
            assert dht.get("retried_key", latest=True).value == 1
        finally:
            dht.shutdown()
    finally:
        dht_logger.removeHandler(comeback)
        if comeback.thread.ident is not None:
            comeback.thread.join(timeout=30)
        for node in restarted:
            node.shutdown()
