"""Start this process's DHT node from PeerArguments, tell the operator how others can join it, and keep it
joined: after a network cut, the node reconnects to the peers it lost."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Hashable, Iterable, Mapping, Sequence

import hivemind
from hivemind.dht.validation import RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr

from arguments import PeerArguments
from collab.access import WebAppAuthorizer
from collab.errors import DHTStartError
from collab.hivemind_fixes import FixedDHT

logger = logging.getLogger(__name__)


def join_command_line(maddrs: Sequence[str]) -> str:
    """The exact flag another peer pastes to join: ``--initial_peers /ip4/.../p2p/...``."""
    return "--initial_peers " + " ".join(maddrs)


def start_dht(
    peer_args: PeerArguments,
    record_validators: Sequence[RecordValidatorBase] = (),
    client_mode: bool | None = None,
) -> hivemind.DHT:
    """Start a DHT node (in its own process) and log the line other peers use to join.

    ``client_mode`` overrides ``peer_args.client_mode`` (the monitor is never a client). With
    ``--authorization_url`` the node first gets an access token from the web app (AccessError if refused).
    """
    client_mode = peer_args.client_mode if client_mode is None else client_mode
    authorizer = None
    if peer_args.authorization_url:
        authorizer = WebAppAuthorizer(peer_args.authorization_url, peer_args.web_token)
        authorizer.fetch_first_token()
    try:
        dht = FixedDHT(
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
        )
    except Exception as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if peer_args.initial_peers and "bootstrap" in message.lower():
            raise DHTStartError(
                f"--initial_peers: none of {', '.join(peer_args.initial_peers)} answered ({message}); "
                "check that the first peer is running and reachable from this machine"
            ) from None
        raise DHTStartError(f"--host_maddrs/--identity_path: the DHT did not start ({message})") from None

    keep_rejoining(dht, peer_args.initial_peers)
    if client_mode:
        logger.info("Joined the collaboration in client mode (no incoming connections)")
    else:
        maddrs = [str(maddr) for maddr in dht.get_visible_maddrs()]
        logger.info("To join this collaboration, start other peers with %s", join_command_line(maddrs))
    return dht


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
