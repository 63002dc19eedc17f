"""A peer that cannot accept connections joins and averages, where the machine allows network namespaces (root).

Three sites, each its own namespace on the hub network of bench.procs (a public range: libp2p builds relayed
addresses from a relay's public addresses only): a relay (a trainer, or the monitor), a third peer and a firewalled
peer whose namespace refuses every inbound TCP connection (its SYN-ACKs are dropped on its own link, so no
connection to it opens, while those it opens and the packets of open ones pass). With --use_auto_relay it reserves
a slot on the relay (its initial peer), says in its ``joined`` event that it is reached through it, and peers that
never talked to it reach it there; in client mode, it says it is not reachable. Either way it must average with the
others. Skipped with the reason where namespaces or the qdiscs this needs are not available."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from collab.dht import relays_in
from tests.integration.sites import hub_or_skip, monitor_at, peer_at
from trainer.local import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.scenario, pytest.mark.timeout(300)]

JOIN_S = 60  # seconds for a peer's joined event (the relay slot is waited for before it)
AVERAGE_S = 120  # seconds, from the firewalled peer's start, for it to average with another peer
RELAY_CHANGE_S = 30  # seconds for a relayed peer to report a relay it lost (it reads its addresses every 10 s)
LINK_MBIT = 1000.0
SETTINGS = [
    "--target_batch_size",
    "64",
    "--matchmaking_time",
    "2",
    "--averaging_timeout",
    "15",
    "--metadata_expiration",
    "10",
]


def netns_exec(netns: str, *command: str, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", netns, *command], capture_output=True, text=True, timeout=timeout)


def refuse_inbound_tcp(netns: str, device: str) -> None:
    """Drop every SYN-ACK ``device`` sends: no TCP connection into ``netns`` completes, outbound ones do.

    An htb tree sends packets with SYN and ACK set (byte 33: TCP flags after a 20-byte IPv4 header) to a class
    whose queue holds nothing; everything else goes to the default class. tc's actions (gact) are not needed.
    """
    commands = [
        ("qdisc", "del", "dev", device, "root"),
        ("qdisc", "add", "dev", device, "root", "handle", "1:", "htb", "default", "2"),
        ("class", "add", "dev", device, "parent", "1:", "classid", "1:1", "htb", "rate", "1mbit"),
        ("class", "add", "dev", device, "parent", "1:", "classid", "1:2", "htb", "rate", f"{LINK_MBIT:g}mbit"),
        ("qdisc", "add", "dev", device, "parent", "1:1", "handle", "10:", "pfifo", "limit", "0"),
        ("filter", "add", "dev", device, "parent", "1:", "protocol", "ip", "prio", "1", "u32")
        + ("match", "ip", "protocol", "6", "0xff", "match", "u8", "0x12", "0x12", "at", "33", "flowid", "1:1"),
    ]
    for command in commands:
        done = netns_exec(netns, "tc", *command)
        if done.returncode != 0:
            pytest.skip(f"cannot firewall a namespace with tc here (tc {' '.join(command)}: {done.stderr.strip()})")


def tcp_connects(from_netns: str, to_netns: str, address: str, port: int = 7711) -> bool:
    """Whether a TCP connection from ``from_netns`` to a listener in ``to_netns`` opens within 3 seconds."""
    listen = (
        "import socket,sys; s=socket.create_server((sys.argv[1], int(sys.argv[2])), reuse_port=True); "
        "s.settimeout(10); print('listening', flush=True); s.accept()"
    )
    connect = "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)"
    listener = subprocess.Popen(
        ["ip", "netns", "exec", to_netns, sys.executable, "-c", listen, address, str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert listener.stdout.readline().strip() == "listening", f"no TCP listener in {to_netns}"
        return netns_exec(from_netns, sys.executable, "-c", connect, address, str(port)).returncode == 0
    finally:
        listener.kill()
        listener.wait()


# A fresh p2pd in a namespace, bootstrapped from the relay, opens a stream to a peer it never talked to, by its ID
# alone (no such handler there: the connection, not the call, is looked at), and prints the addresses of its
# connection to that peer, if it has one.
DIAL_BY_ID = """
import asyncio, sys
from hivemind.p2p import P2P, PeerID

async def main(host, target, *relays):
    p2p = await P2P.create(host_maddrs=[f"/ip4/{host}/tcp/0"], initial_peers=list(relays))
    try:
        try:
            await asyncio.wait_for(p2p.call_binary_stream_handler(PeerID.from_base58(target), "relay-test"), 20)
        except Exception:
            pass
        for info in await p2p.list_peers():
            if info.peer_id.to_base58() == target:
                print(*info.addrs)
    finally:
        await p2p.shutdown()

asyncio.run(main(*sys.argv[1:]))
"""


def connection_addresses(site, peer_id: str, initial_peers: list[str]) -> list[str]:
    """The addresses of the connection a fresh peer at ``site`` opens to ``peer_id`` (none if it could not)."""
    done = netns_exec(site.netns, sys.executable, "-c", DIAL_BY_ID, site.address, peer_id, *initial_peers, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


@contextlib.contextmanager
def sites_with_a_firewall(count: int, prefix: str, subnet: str) -> Iterator:
    """``count`` namespaces on one hub, the third (index 2) firewalled: no inbound TCP reaches it, it dials out."""
    # libp2p builds relayed addresses from a relay's public addresses only (private ones are dropped), so the hub
    # uses a public range; its namespaces route nowhere else
    with hub_or_skip(count, LINK_MBIT, prefix=prefix, subnet=subnet) as network:
        other, walled = network.peers[1], network.peers[2]
        assert tcp_connects(other.netns, walled.netns, walled.address), "the hub network does not connect"
        refuse_inbound_tcp(walled.netns, walled.device)
        assert not tcp_connects(other.netns, walled.netns, walled.address), "inbound TCP still reaches the peer"
        assert tcp_connects(walled.netns, other.netns, other.address), "the firewalled peer cannot dial out"
        yield network


@pytest.fixture
def three_sites():
    """Namespaces on one hub: the relay, the third peer, and the firewalled peer (no inbound TCP)."""
    with sites_with_a_firewall(3, prefix="relaytest", subnet="11.77.0") as network:
        yield network


def peer_id(address: str) -> str:
    """The peer ID that ends a multiaddr (``.../p2p/ID``)."""
    return address.rsplit("/p2p/", 1)[1]


def averaged_with_others(peer) -> bool:
    return any(size >= 2 for size in peer.averaging_group_sizes())


def run_swarm(network, tmp_path, walled_flags: list[str], check=lambda joined, relay_join: None) -> dict:
    """Start the relay and third peers, then the firewalled one with ``walled_flags``; wait until the firewalled
    peer averaged with another, then ``check(its joined event, the relay's join flags)`` while all run; its
    ``joined`` event."""
    relay, third, walled = network.peers
    common = ["--experiment_prefix", f"relay{int(time.time())}", *SETTINGS]

    def peer(site, name, flags):
        return peer_at(site, [*common, *flags], tmp_path, name)

    peers = [peer(relay, "relay", ["--use_relay", "true"])]
    try:
        join = peers[0].join_flags(timeout=JOIN_S)
        peers.append(peer(third, "third", join))
        peers.append(peer(walled, "walled", [*join, *walled_flags]))
        started = time.monotonic()
        joined = peers[2].wait_for_event("joined", JOIN_S)
        wait_until(
            lambda: averaged_with_others(peers[2]),
            AVERAGE_S - (time.monotonic() - started),
            "the firewalled peer to average with another peer",
        )
        check(joined, join)
        assert all(p.process.poll() is None for p in peers), "a peer died"
        assert not peers[2].tracebacks_from_our_code()
    finally:
        codes = [p.stop() for p in peers]
    assert codes == [0] * len(peers)
    return joined


def test_a_peer_that_accepts_no_connections_joins_through_a_relay_and_averages(three_sites, tmp_path, sample_data):
    relay, third, _ = three_sites.peers
    reached = []

    def dial_it_through_the_relay(joined, relay_join):
        walled_id = peer_id(joined["address"][0])
        reached.extend(connection_addresses(third, walled_id, relay_join[1:]))

    joined = run_swarm(three_sites, tmp_path, ["--use_auto_relay", "true"], check=dial_it_through_the_relay)
    assert joined["reachable"] is True and joined["reached_via"] == "relay", joined
    # every address it announces goes through a relay, the relay peer's among them: its own address is unreachable
    assert all("/p2p-circuit/" in address for address in joined["address"]), joined
    assert any(address.startswith(f"/ip4/{relay.address}/") for address in joined["address"]), joined
    # and a peer that never talked to it connects to it, through the relay (the relay, at a public address, kept
    # the slot it reserved: collab.dht's forced reachability)
    assert reached and all("/p2p-circuit" in address for address in reached), reached


def test_a_client_behind_a_firewall_joins_and_averages(three_sites, tmp_path, sample_data):
    joined = run_swarm(three_sites, tmp_path, ["--client_mode", "true"])
    assert joined["reachable"] is False and joined["reached_via"] == "client_mode"


def test_a_newcomer_downloads_the_state_from_a_peer_reached_only_through_a_relay(three_sites, tmp_path, sample_data):
    """The monitor, at a public address, is the bootstrap and the relay (it shares no state); the firewalled peer
    trains alone, so a newcomer at the third site can load the swarm's state from it only, through the relay."""
    relay, third, walled = three_sites.peers
    prefix = ["--experiment_prefix", f"relaystate{int(time.time())}"]
    common = [*prefix, *SETTINGS]
    monitor = monitor_at(relay, [*prefix, "--refresh_period", "1"], tmp_path, "monitor")
    peers = [monitor]
    try:
        join = monitor.join_flags(timeout=JOIN_S)
        peers.append(peer_at(walled, [*common, *join, "--use_auto_relay", "true"], tmp_path, "walled"))
        assert peers[1].wait_for_event("joined", JOIN_S)["reached_via"] == "relay"
        wait_until(lambda: peers[1].latest_epoch() >= 2, AVERAGE_S, "the firewalled peer to train alone")
        peers.append(peer_at(third, [*common, *join], tmp_path, "newcomer"))
        loaded = peers[2].wait_for_event("state_loaded", AVERAGE_S)
        wait_until(
            lambda: averaged_with_others(peers[2]), AVERAGE_S, "the newcomer to average with the firewalled peer"
        )
        assert all(p.process.poll() is None for p in peers), "a process died"
    finally:
        codes = [p.stop() for p in peers]
    assert codes == [0] * len(peers)
    # the state came from the firewalled peer (nobody else holds one): its epoch, not the newcomer's own start
    assert loaded["epoch"] >= 2 and loaded["epoch_before"] == 0, loaded


def relays_changed(peer, relays: list[str]) -> dict:
    """``peer``'s first ``relays_changed`` event that leaves it with ``relays``, waited for."""
    return peer.wait_for_event("relays_changed", RELAY_CHANGE_S, where=lambda record: record["relays"] == relays)


def test_a_peer_with_two_relays_stays_reachable_when_one_leaves_and_says_when_none_is_left(tmp_path, sample_data):
    """The monitor and a trainer are both relays and both initial peers of the firewalled peer; a fresh peer at a
    fourth site reaches it through the trainer once the monitor is killed, and when the trainer stops too, the
    firewalled peer says it is no longer reachable (libp2p asks a relay again only an hour after its reservation)."""
    with sites_with_a_firewall(4, prefix="relaytwo", subnet="11.77.1") as network:
        first, second, walled, fresh = network.peers
        prefix = ["--experiment_prefix", f"relaytwo{int(time.time())}"]
        monitor = monitor_at(first, [*prefix, "--refresh_period", "1"], tmp_path, "monitor")
        processes = [monitor]
        try:
            join_first = monitor.join_flags(timeout=JOIN_S)
            processes.append(
                peer_at(second, [*prefix, *SETTINGS, *join_first, "--use_relay", "true"], tmp_path, "relay")
            )
            join_second = processes[1].join_flags(timeout=JOIN_S)
            relays = [peer_id(join_first[1]), peer_id(join_second[1])]
            flags = [*prefix, *SETTINGS, *join_first, *join_second[1:], "--use_auto_relay", "true"]
            processes.append(peer_at(walled, flags, tmp_path, "walled"))
            joined = processes[2].wait_for_event("joined", JOIN_S)
            walled_id = peer_id(joined["address"][0])
            assert set(relays_in(joined["address"])) == set(relays), joined  # a slot on each

            monitor.crash()
            lost_one = relays_changed(processes[2], [relays[1]])
            assert lost_one["lost"] == [relays[0]] and lost_one["gained"] == [], lost_one
            reached = connection_addresses(fresh, walled_id, join_second[1:])
            assert reached and all(address.startswith(join_second[1] + "/p2p-circuit") for address in reached)

            assert processes[1].stop() == 0
            lost_both = relays_changed(processes[2], [])
            assert lost_both["lost"] == [relays[1]], lost_both
            assert "Not reachable any more: no relay holds a slot" in processes[2].log()
            assert processes[2].process.poll() is None and not processes[2].tracebacks_from_our_code()
        finally:
            codes = [p.stop() for p in processes]
    assert codes[1:] == [0, 0], codes  # the monitor was killed
