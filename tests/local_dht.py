"""Real hivemind DHT nodes on 127.0.0.1 for tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import hivemind


@contextlib.contextmanager
def two_dhts() -> Iterator[tuple[hivemind.DHT, hivemind.DHT]]:
    """Two DHT nodes on 127.0.0.1, the second joined to the first; shut down afterwards."""
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        second = hivemind.DHT(
            start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs()
        )
        try:
            yield first, second
        finally:
            second.shutdown()
    finally:
        first.shutdown()
