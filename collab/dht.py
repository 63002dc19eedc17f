"""Start this process's DHT node from PeerArguments, tell the operator in one line whether and how others can reach
it, and keep it joined: after a network cut, the node reconnects to the peers it lost."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import ipaddress
import itertools
import logging
import time
from collections.abc import Hashable, Iterable, Mapping, Sequence

import hivemind
from hivemind.dht.validation import RecordValidatorBase
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr

from arguments import PeerArguments
from collab import events
from collab.access import WebAppAuthorizer
from collab.errors import DHTStartError
from collab.hivemind_fixes import FixedDHT, progress_key

logger = logging.getLogger(__name__)


def join_command_line(maddrs: Sequence[str]) -> str:
    """The exact flag another peer pastes to join: ``--initial_peers /ip4/.../p2p/...``."""
    return "--initial_peers " + " ".join(maddrs)


RELAY_WAIT = 15.0  # seconds a --use_auto_relay peer waits for a relay slot before reporting how it is reached
RELAY_SETTLE_S = 3.0  # seconds it waits on, once it holds one slot, for slots on its other relays
RELAY_CHECK_PERIOD = 10.0  # seconds between two reads of a --use_auto_relay peer's relays
RELAY_BACKOFF_HOURS = 1  # libp2p autorelay's backoff, which p2pd cannot set (docs/RELIABILITY.md, Reachability)
BACKOFF_NOTE = (
    f"a relay that comes back is asked again within 30 s, but not before {RELAY_BACKOFF_HOURS} hour has passed since "
    "this peer reserved its slot there, libp2p's backoff"
)
ONE_RELAY_ADVICE = (
    f"one relay: if it leaves, this peer is unreachable; {BACKOFF_NOTE}; two or more --initial_peers running "
    "--use_relay keep it reachable"
)
PREFIX_CHECK_TIMEOUT = 5.0  # seconds to look for the experiment's records under --experiment_prefix
# Best first: how another peer can reach this one, by the kind of its visible addresses.
REACHED_VIA = ("public", "relay", "private", "loopback")


@dataclasses.dataclass(frozen=True)
class Reachability:
    """Whether other peers can open connections to this one, and through what kind of address.

    ``via``: "public" (an internet address), "relay" (a /p2p-circuit address through a relay peer), "private" (a
    LAN or NAT address: this network only), "loopback" (this machine only), "client_mode" or "none" (unreachable).
    """

    reachable: bool
    via: str
    addresses: tuple[str, ...] = ()


def address_kind(maddr: str) -> str:
    """Who can dial ``maddr`` (a multiaddr string): "relay", "loopback", "private" or "public"."""
    if "/p2p-circuit" in maddr:
        return "relay"
    parts = maddr.split("/")
    protocol, host = (parts[1], parts[2]) if len(parts) > 2 else ("", "")
    if protocol in ("dns", "dns4", "dns6", "dnsaddr"):
        return "public"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return "private"  # not an address anyone is known to reach
    if ip.is_loopback:
        return "loopback"
    return "public" if ip.is_global else "private"


def reachability(maddrs: Sequence[str], client_mode: bool) -> Reachability:
    """How others reach a node with these visible addresses: through its best kind of address (REACHED_VIA order)."""
    if client_mode:
        return Reachability(False, "client_mode")
    kinds = {address_kind(maddr) for maddr in maddrs}
    for via in REACHED_VIA:
        if via in kinds:
            return Reachability(True, via, tuple(maddrs))
    return Reachability(False, "none")


_HOW_REACHED = {
    "public": "reachable at a public address",
    "relay": "reachable through a relay (inbound connections to this peer are relayed)",
    "private": "reachable on this private network only (behind NAT: --use_auto_relay or --announce_maddrs)",
    "loopback": "reachable from this machine only (listen on /ip4/0.0.0.0/tcp/PORT for other machines)",
    "client_mode": "not reachable: client mode (this peer only dials out; others cannot connect to it)",
    "none": "not reachable: no visible address (check --host_maddrs)",
}


def reachability_line(
    reach: Reachability, use_relay: bool, prefix: str, peers_found: int | None, asked_for_relay: bool = False
) -> str:
    """The one start-up line: reachable or not and through what, relays, then what was found under the prefix.

    ``peers_found``: peers with progress records under ``prefix``, -1 if the lookup found none in time, None if
    not looked up (a first peer). ``asked_for_relay``: the peer runs with --use_auto_relay.
    """
    how = _HOW_REACHED[reach.via]
    line = how[0].upper() + how[1:]
    line += "; relays " + ("on" if use_relay else "off (--use_relay false)")
    if asked_for_relay and reach.via != "relay":
        # libp2p builds relayed addresses from a relay's public addresses only
        line += (
            f"; --use_auto_relay: no relay slot within {RELAY_WAIT:g} s (the relays are the --initial_peers, "
            "which must be at a public address and run with --use_relay)"
        )
    elif asked_for_relay and len(relays_in(reach.addresses)) == 1:
        line += "; " + ONE_RELAY_ADVICE
    if peers_found is not None and peers_found < 0:
        line += (
            f"; no records under --experiment_prefix {prefix} within {PREFIX_CHECK_TIMEOUT:g} s "
            "(a wrong prefix, or no trainer has joined yet)"
        )
    elif peers_found is not None:
        line += f"; {peers_found} peer(s) training under --experiment_prefix {prefix}"
    if reach.reachable:
        line += "; start other peers with " + join_command_line(reach.addresses)
    return line


def relays_in(addresses: Iterable[str]) -> tuple[str, ...]:
    """The peer IDs of the relays that these /p2p-circuit addresses go through, sorted, each once."""
    relays = set()
    for maddr in addresses:
        relay_part, circuit, _ = maddr.partition("/p2p-circuit")
        if circuit and "/p2p/" in relay_part:
            relays.add(relay_part.rsplit("/p2p/", 1)[1])
    return tuple(sorted(relays))


def relays_changed_line(after: Sequence[str], lost: Sequence[str], gained: Sequence[str]) -> str:
    """The line a --use_auto_relay peer logs when the relays it is reached through change to ``after``."""
    changes = [f"lost {', '.join(lost)}"] if lost else []
    changes += [f"gained {', '.join(gained)}"] if gained else []
    if not after:
        return (
            f"Not reachable any more: no relay holds a slot for this peer ({'; '.join(changes)}); it still dials "
            f"out; {BACKOFF_NOTE}; two or more --initial_peers running --use_relay keep a peer reachable"
        )
    return f"Reachable through {len(after)} relay(s) now ({'; '.join(changes)})"


@dataclasses.dataclass
class RelayWatch:
    """The relays a --use_auto_relay peer is reached through; ``check`` reports a change in a line and a
    ``relays_changed`` event (docs/EVENTS.md)."""

    relays: tuple[str, ...]

    def check(self, addresses: Sequence[str]) -> None:
        relays = relays_in(addresses)
        if set(relays) == set(self.relays):
            return
        lost = [relay for relay in self.relays if relay not in relays]
        gained = [relay for relay in relays if relay not in self.relays]
        events.emit("relays_changed", relays=list(relays), lost=lost, gained=gained)
        logger.log(logging.INFO if relays else logging.WARNING, relays_changed_line(relays, lost, gained))
        self.relays = relays


async def _watch_relays_forever(node, watch: RelayWatch, period: float) -> None:
    """Runs inside the DHT process: every ``period`` seconds, read this node's addresses and report a change of the
    relays it is reached through (libp2p drops a relay's addresses when its connection to it closes)."""
    while node.is_alive:
        await asyncio.sleep(period)
        try:
            addresses = [str(maddr) for maddr in await node.get_visible_maddrs(latest=True)]
        except ValueError:
            addresses = []  # hivemind's answer when the node has no visible address
        except Exception as e:  # the daemon is shutting down with the node: the loop ends with it
            logger.debug("Could not read this node's addresses: %r", e)
            continue
        watch.check(addresses)


async def _start_watching_relays(_dht, node, watch: RelayWatch, period: float) -> None:
    asyncio.create_task(_watch_relays_forever(node, watch, period))


def watch_relays(dht: hivemind.DHT, addresses: Sequence[str], period: float = RELAY_CHECK_PERIOD) -> None:
    """Make ``dht`` report, every ``period`` seconds, when the relays of its addresses change (``RelayWatch``)."""
    dht.run_coroutine(functools.partial(_start_watching_relays, watch=RelayWatch(relays_in(addresses)), period=period))


def visible_addresses(dht: hivemind.DHT) -> list[str]:
    """This node's visible multiaddrs as strings; empty if it has none (hivemind raises ValueError then)."""
    try:
        return [str(maddr) for maddr in dht.get_visible_maddrs(latest=True)]
    except ValueError:
        return []


def joined_fields(dht: hivemind.DHT, client_mode: bool) -> dict:
    """The fields of the ``joined`` event (docs/EVENTS.md): addresses, client mode, reachable and through what."""
    addresses = visible_addresses(dht)
    reach = reachability(addresses, client_mode)
    return {"address": addresses, "client_mode": client_mode, "reachable": reach.reachable, "reached_via": reach.via}


def listens_at_a_public_address(peer_args: PeerArguments) -> bool:
    """Whether this peer listens at, or announces, an internet (public) address."""
    return any(address_kind(maddr) == "public" for maddr in [*peer_args.host_maddrs, *peer_args.announce_maddrs])


class StaticRelaysP2P(P2P):
    """hivemind's P2P whose daemon, when given trusted relays with auto-relay, reserves slots on those relays at once.

    hivemind starts p2pd with relay discovery on (its ``use_relay_discovery`` has no effect), and libp2p's
    discovery reserves a slot only once it holds 4 relay candidates or after its 3-minute boot delay. With discovery
    off, p2pd takes the trusted relays as libp2p's static relays, all of them candidates from the start."""

    @staticmethod
    def _make_process_args(*args, **kwargs) -> list[str]:
        if kwargs.get("autoRelay") and kwargs.get("trustedRelays"):
            kwargs["relayDiscovery"] = False
        return P2P._make_process_args(*args, **kwargs)


class RelayedDHT(FixedDHT):
    """A DHT whose node starts its daemon through ``StaticRelaysP2P``: hivemind's DHTNode starts it with
    ``hivemind.dht.node.P2P``, swapped in the DHT's own process only (the peer's hivemind is left as it is)."""

    def run(self) -> None:
        hivemind.dht.node.P2P = StaticRelaysP2P
        super().run()


def start_dht(
    peer_args: PeerArguments,
    record_validators: Sequence[RecordValidatorBase] = (),
    client_mode: bool | None = None,
) -> hivemind.DHT:
    """Start a DHT node (in its own process) and log in one line whether other peers can reach it, and how.

    ``client_mode`` overrides ``peer_args.client_mode`` (the monitor is never a client). With
    ``--authorization_url`` the node first gets an access token from the web app (AccessError if refused).
    DHTStartError when no initial peer answers.
    """
    client_mode = peer_args.client_mode if client_mode is None else client_mode
    asks_for_relay = peer_args.use_auto_relay and not client_mode
    authorizer = None
    if peer_args.authorization_url:
        authorizer = WebAppAuthorizer(peer_args.authorization_url, peer_args.web_token)
        authorizer.fetch_first_token()
    relay_kwargs = {"use_relay": peer_args.use_relay, "use_auto_relay": peer_args.use_auto_relay}
    if peer_args.use_auto_relay:
        # libp2p reserves relay slots only once it believes the peer is private; AutoNAT needs several peers
        # and minutes to decide that, so a peer that asks for a relay says so itself. Its relays are its initial
        # peers (StaticRelaysP2P).
        relay_kwargs |= {"force_reachability": "private", "trusted_relays": peer_args.initial_peers}
    elif peer_args.use_relay and not client_mode and listens_at_a_public_address(peer_args):
        # libp2p starts a second relay service when AutoNAT finds the peer public, in place of p2pd's own, and
        # every reservation the first one held is lost (relayed peers are refused, NO_RESERVATION): a peer at a
        # public address, a relay for others, says so from the start
        relay_kwargs["force_reachability"] = "public"
    dht_class = RelayedDHT if peer_args.use_auto_relay and peer_args.initial_peers else FixedDHT
    try:
        dht = dht_bootstrapped_within(
            dht_class,
            peer_args.bootstrap_timeout,
            start=True,
            initial_peers=peer_args.initial_peers,
            client_mode=client_mode,
            record_validators=list(record_validators),
            use_ipfs=peer_args.use_ipfs,
            host_maddrs=peer_args.host_maddrs,
            announce_maddrs=peer_args.announce_maddrs,
            identity_path=peer_args.identity_path,
            wait_timeout=peer_args.bootstrap_timeout,
            authorizer=authorizer,
            **relay_kwargs,
        )
    except Exception as e:
        message = first_line(e)
        if peer_args.initial_peers and is_bootstrap_failure(message):
            refused = " or they refused this peer's access token" if authorizer is not None else ""
            raise DHTStartError(
                f"--initial_peers: none of {', '.join(peer_args.initial_peers)} answered ({message}); "
                f"check that the first peer is running and reachable from this machine{refused}"
            ) from None
        raise DHTStartError(f"--host_maddrs/--identity_path: the DHT did not start ({message})") from None

    keep_rejoining(dht, peer_args.initial_peers)
    addresses = visible_addresses(dht)
    if asks_for_relay:
        addresses = wait_for_relay_address(dht, addresses, relays_asked=len(peer_args.initial_peers))
        watch_relays(dht, addresses)
    peers_found = count_peers_under_prefix(dht, peer_args.experiment_prefix) if peer_args.initial_peers else None
    reach = reachability(addresses, client_mode)
    line = reachability_line(reach, peer_args.use_relay, peer_args.experiment_prefix, peers_found, asks_for_relay)
    logger.info(line)
    return dht


BOOTSTRAP_RETRY_S = (1.0, 2.0, 4.0)  # pauses between a daemon's bootstrap tries, the last repeated


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def is_bootstrap_failure(message: str) -> bool:
    """Whether a DHT's start failed because p2pd reached none of its initial peers."""
    return "bootstrap" in message.lower()


def dht_bootstrapped_within(dht_class: type, timeout: float, **kwargs) -> hivemind.DHT:
    """``dht_class(**kwargs)``, its start tried again while its p2pd reaches none of the initial peers, until
    ``timeout`` seconds (``--bootstrap_timeout``) have passed. p2pd tries each initial peer once and exits: an initial
    peer that starts a moment later, or whose machine stalls for a moment, ended a peer's start at once, whatever the
    timeout said (seen once on 127.0.0.1 in a loaded test run). Other failures end it at once."""
    deadline = time.monotonic() + timeout
    for tries in itertools.count(1):
        try:
            return dht_class(**kwargs)
        except Exception as e:
            pause = BOOTSTRAP_RETRY_S[min(tries, len(BOOTSTRAP_RETRY_S)) - 1]
            if not is_bootstrap_failure(first_line(e)) or time.monotonic() + pause > deadline:
                raise
            logger.warning("No initial peer answered (%s): trying again in %.0f s", first_line(e), pause)
            time.sleep(pause)


def relay_wait_over(relays: int, relays_asked: int, since_first_s: float, waited_s: float, timeout: float) -> bool:
    """Whether a --use_auto_relay peer stops waiting for relay slots: it holds one on each relay it asked
    (``relays_asked``: its initial peers), or has held one for ``RELAY_SETTLE_S`` (``since_first_s``; others may not
    relay), or waited ``timeout`` seconds with none."""
    if relays:
        return relays >= relays_asked or since_first_s >= RELAY_SETTLE_S
    return waited_s >= timeout


def wait_for_relay_address(
    dht: hivemind.DHT, addresses: list[str], relays_asked: int, timeout: float = RELAY_WAIT
) -> list[str]:
    """This node's visible addresses once they go through its relays (``relay_wait_over``)."""
    started = first_slot = time.monotonic()
    while True:
        now, relays = time.monotonic(), len(relays_in(addresses))
        first_slot = first_slot if relays else now  # the clock since the first slot runs once there is one
        if relay_wait_over(relays, relays_asked, now - first_slot, now - started, timeout):
            return addresses
        time.sleep(0.5)
        addresses = visible_addresses(dht)


def count_peers_under_prefix(dht: hivemind.DHT, prefix: str, timeout: float = PREFIX_CHECK_TIMEOUT) -> int:
    """Peers with a progress record under ``prefix`` (hivemind's ProgressTracker key); -1 when none was found
    within ``timeout`` seconds."""
    try:
        found = dht.get(progress_key(prefix), latest=True, return_future=True).result(timeout=timeout)
    except Exception:
        return -1
    records = getattr(found, "value", None)
    return len(records) if isinstance(records, dict) and records else -1


REJOIN_PERIOD = 10.0  # seconds between two rounds of pings to known peers missing from the routing table
REMEMBER_PEERS_FOR = 600.0  # seconds a lost peer is retried; about as long as libp2p keeps its addresses
MAX_PINGS_PER_ROUND = 16  # the most recently seen lost peers are pinged first


def plan_rejoin(
    last_seen: Mapping[Hashable, float],
    present: Iterable[Hashable],
    initial_peers: Iterable[Hashable],
    now: float,
    remember_for: float = REMEMBER_PEERS_FOR,
    max_pings: int = MAX_PINGS_PER_ROUND,
) -> tuple[dict[Hashable, float], list[Hashable]]:
    """Who to ping this round, and the updated ``peer -> last time it was in the routing table``.

    Peers seen within ``remember_for`` seconds that are missing from the routing table now get pinged, most
    recently seen first. A node whose table is empty also pings its initial peers, however long ago it saw
    them: an isolated node bootstraps again.
    """
    present = set(present)
    seen = {peer: time for peer, time in last_seen.items() if now - time <= remember_for}
    seen.update(dict.fromkeys(present, now))
    lost = sorted((peer for peer in seen if peer not in present), key=lambda peer: seen[peer], reverse=True)
    if not present:
        lost += [peer for peer in dict.fromkeys(initial_peers) if peer not in seen]
    return seen, lost[:max_pings]


async def _rejoin_forever(node, initial_peers: list[PeerID], period: float) -> None:
    """Runs inside the DHT process: every ``period`` seconds, ping the known peers the routing table lost.

    hivemind drops a peer from the routing table after one unanswered request and never looks for it again,
    so two sides of a network cut stay apart for good once the link is back (measured: both tables stay
    empty 110 s after a 25 s cut). A ping that gets an answer puts both nodes back in each other's table.
    """
    last_seen: dict = {}
    while node.is_alive:
        now = get_dht_time()
        present = node.protocol.routing_table.peer_id_to_uid.keys()
        last_seen, lost = plan_rejoin(last_seen, present, initial_peers, now)
        if lost:
            answers = await asyncio.gather(*(node.protocol.call_ping(peer) for peer in lost), return_exceptions=True)
            back = sum(1 for answer in answers if answer is not None and not isinstance(answer, BaseException))
            if back:
                logger.info("Reconnected to %d of %d peer(s) this node had lost (a network cut?)", back, len(lost))
        await asyncio.sleep(period)


async def _start_rejoining(_dht, node, initial_peers: list[PeerID], period: float) -> None:
    asyncio.create_task(_rejoin_forever(node, initial_peers, period))


def keep_rejoining(dht: hivemind.DHT, initial_peers: Sequence[str] = (), period: float = REJOIN_PERIOD) -> None:
    """Make ``dht`` reconnect, every ``period`` seconds, to peers it lost (see ``_rejoin_forever``)."""
    peer_ids = [PeerID.from_base58(Multiaddr(maddr)["p2p"]) for maddr in initial_peers if "/p2p/" in maddr]
    dht.run_coroutine(functools.partial(_start_rejoining, initial_peers=peer_ids, period=period))
