"""Start this process's DHT node from PeerArguments and tell the operator how others can join it."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import hivemind
from hivemind.dht.validation import RecordValidatorBase

from arguments import PeerArguments
from collab.access import WebAppAuthorizer

logger = logging.getLogger(__name__)


class DHTStartError(RuntimeError):
    """The DHT could not start: the message says which setting to check."""


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
        dht = hivemind.DHT(
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

    if client_mode:
        logger.info("Joined the collaboration in client mode (no incoming connections)")
    else:
        maddrs = [str(maddr) for maddr in dht.get_visible_maddrs()]
        logger.info("To join this collaboration, start other peers with %s", join_command_line(maddrs))
    return dht
