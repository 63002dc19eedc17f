"""A newcomer's state download begun as soon as its DHT is up, beside the build of its optimizer.

hivemind downloads the state once the optimizer exists (its averagers serve and fetch it). Building that optimizer
touches every buffer it allocates, seconds to tens of seconds for a large model during which a newcomer's link would
sit idle (docs/benchmarks/2026-11-30-intel-xeon-2core-join-prefetch.md). ``StatePrefetch`` makes the first try of
the first load earlier, in a thread of its own with its own connection to the DHT's p2p daemon; the load then takes
its result (``FiniteTrainingStateAverager.load_state_from_peers``) and checks and applies it as any other try's. It
picks its donor and bounds the donor's epoch and its own time as that load does, and downloads nothing where no
peer advertises a state (a founder).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import hivemind
from hivemind.p2p import P2P, PeerID

from collab.averagers import DownloadTry, download_state, find_donor, max_donor_epoch, swarm_epoch

logger = logging.getLogger(__name__)

CANCEL_POLL = 0.5  # seconds between two looks of the download at whether the peer cancelled it
RESULT_MARGIN = 30.0  # seconds a load waits for a prefetch past its timeout: its DHT reads and its last chunk


class StatePrefetch:
    """One download of the swarm's state, begun now in a daemon thread (``start``). ``result()`` waits for it and
    gives its ``DownloadTry``, or None where no donor was found;
    ``cancel()`` stops it. ``began`` is when it began (``time.monotonic()``); ``donor``, the peer it asks, once
    chosen."""

    def __init__(
        self,
        dht: hivemind.DHT,
        run_id: str,
        averager_class: type,
        timeout: float,
        chunk_timeout: float | None,
        first_chunk_timeout: float | None = None,
    ):
        self.dht, self.run_id, self.averager_class = dht, run_id, averager_class
        self.prefix = f"{run_id}_state_averager"  # hivemind.Optimizer's name for its state averager
        self.timeout, self.chunk_timeout, self.first_chunk_timeout = timeout, chunk_timeout, first_chunk_timeout
        self.began = time.monotonic()
        self.donor: PeerID | None = None
        self._result: DownloadTry | None = None
        self._done, self._cancelled = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="state-prefetch", daemon=True)

    @classmethod
    def start(cls, *args, **kwargs) -> StatePrefetch:
        prefetch = cls(*args, **kwargs)
        prefetch._thread.start()
        return prefetch

    def result(self) -> DownloadTry | None:
        """The download's outcome, once it ended (at most ``timeout`` plus a margin from now: then it is cancelled
        and counts as a failed try of its donor, or as no donor if it had none yet)."""
        if not self._done.wait(self.timeout + RESULT_MARGIN):
            logger.warning("The state download begun at start-up did not end in time: cancelled")
            self.cancel()
            self._done.wait(4 * CANCEL_POLL)  # then it ends as a failed try of its donor
        result, self._result = self._result, None  # the tensors are the load's now
        return result

    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        self._cancelled.set()

    def _run(self) -> None:
        try:
            peer_id = self.dht.peer_id
            max_epoch = max_donor_epoch(swarm_epoch(self.dht, self.run_id, peer_id), self.timeout)
            self.donor = find_donor(self.dht, self.prefix, max_epoch, {peer_id})
            if self.donor is None or self._cancelled.is_set():
                return
            logger.info("Downloading the state from peer %s while this peer starts", self.donor)
            self._result = asyncio.run(self._download(self.donor))
        except Exception as e:
            logger.warning("The state download begun at start-up failed: %r", e)
            self._result = None if self.donor is None else DownloadTry(self.donor)
        finally:
            self._done.set()

    async def _download(self, donor: PeerID) -> DownloadTry:
        # a client of its own to the DHT's p2p daemon: the one hivemind caches (replicate_p2p) is bound to one loop
        p2p = await P2P.replicate(self.dht.run_coroutine(hivemind.DHT._get_p2p_daemon_listen_maddr))
        try:
            download = asyncio.create_task(
                download_state(
                    p2p, self.averager_class, self.prefix, donor, self.chunk_timeout, self.first_chunk_timeout
                )
            )
            deadline = time.monotonic() + self.timeout
            while not download.done() and not self._cancelled.is_set() and time.monotonic() < deadline:
                await asyncio.wait({download}, timeout=CANCEL_POLL)
            if not download.done():
                download.cancel()
                why = "cancelled" if self._cancelled.is_set() else f"took over {self.timeout:.0f} s"
                logger.warning("Downloading the state from peer %s %s: stopped", donor, why)
                return DownloadTry(donor)
            if download.exception() is not None:
                logger.warning("Downloading the state from peer %s failed: %r", donor, download.exception())
                return DownloadTry.failed(donor, download.exception())
            return DownloadTry(donor, *download.result())
        finally:
            await p2p.shutdown()
