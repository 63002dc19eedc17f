"""Parameter rounds on demand: a newcomer catching up asks the swarm for a parameter round instead of waiting for the
next regular one.

In the low-communication mode parameter rounds come every 16 to 32 outer rounds (``lowcomm.parameter_round_every``),
and a newcomer whose downloaded state arrived rounds old keeps its parameters out of the swarm until one has given it
the swarm's anchor (``BoundedLoadOptimizer._begin_catching_up``; meanwhile its pseudo-gradients count only weighted
down, and not at all from a state over ``MAX_CONTRIBUTING_LAG`` rounds old): with rounds of minutes waiting for a
regular one is up to hours of a volunteer's GPU. So it
stores a request, key ``{experiment_prefix}_repairs``, subkey its public key (signed: only it can change its own),
value the global epoch at whose start it wants the round. Every peer reads the requests at each epoch's start and
again as the epoch nears its end, and runs a parameter round at a requested epoch as at a regular one.

Peers must agree on a round without talking. Each reads the requests again when its epoch nears its end (within
``matchmaking_time`` of it, when hivemind pre-schedules the round), so a request stored well before then
(``next_epoch_in_reach``: NEXT_EPOCH_MARGIN matchmaking times and NEXT_EPOCH_SLACK_S seconds before, by the
tracker's estimate) may name the next epoch; otherwise it names the one after, which every peer reads as the next
epoch begins. A peer that missed a request only stays out of that round; a round that leaves the newcomer short is
asked for again. Any key can ask, so the cost of hostile or forgotten requests is bounded by where they may fall:
only epochs that are multiples of REPAIR_GRANULARITY are honoured, whatever the number of keys asking, so requests
add at most one parameter round per REPAIR_GRANULARITY rounds.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from hivemind.utils import get_dht_time

from collab import events
from collab.schema import MAX_STEP

logger = logging.getLogger(__name__)

REPAIR_GRANULARITY = 2  # honoured epochs are multiples of it: at most one extra parameter round per this many rounds
# A request may name the next epoch when the current one has this many matchmaking times plus these seconds left:
# the peers' near-end reads come a matchmaking time before the end; the rest covers the store's and read's latency and
# the spread of the peers' estimates of that end.
NEXT_EPOCH_MARGIN = 2.0
NEXT_EPOCH_SLACK_S = 5.0
REQUEST_TTL_S = 6 * 3600.0  # a request outlives any round; one of a past epoch is never honoured again
# A round that averaged a few of a peer's values with no one (a reducer's reply cut short) leaves just those apart, by
# a bounded offset: later averages are shared, and the momentum left apart fades by 0.9 a round. A repair is a whole
# parameter round, 4 bytes a parameter, which stalled a swarm at 0.69 Mbit/s for 73 s over 384 of 1M values
# (docs/benchmarks/2026-12-03-amd-epyc-2core-proportional-repair.md): under this share the regular round repairs them.
LEFT_APART_REPAIR_SHARE = 0.01


def repairs_key(experiment_prefix: str) -> str:
    return f"{experiment_prefix}_repairs"


def next_epoch_in_reach(seconds_left: float, matchmaking_time: float) -> bool:
    """Whether a request stored with ``seconds_left`` in the swarm's epoch is read by every peer before it ends."""
    return seconds_left > NEXT_EPOCH_MARGIN * matchmaking_time + NEXT_EPOCH_SLACK_S


def repair_epoch(swarm_epoch: int, in_reach: bool = False) -> int:
    """The epoch a peer catching up at ``swarm_epoch`` asks for: the first multiple of REPAIR_GRANULARITY past it,
    past the next one too unless ``in_reach`` (``next_epoch_in_reach``)."""
    earliest = swarm_epoch + (1 if in_reach else 2)
    return -(-earliest // REPAIR_GRANULARITY) * REPAIR_GRANULARITY


def worth_a_repair(kept_local: int, values: int) -> bool:
    """Whether a round that kept ``kept_local`` of a peer's ``values`` as they were (averaged with no one) left it
    apart enough to ask for a parameter round now: LEFT_APART_REPAIR_SHARE of them or more."""
    return kept_local > 0 and kept_local >= LEFT_APART_REPAIR_SHARE * values


def honoured_epochs(values: Iterable) -> frozenset[int]:
    """The requested epochs a peer acts on: plain ints in [0, MAX_STEP] on the REPAIR_GRANULARITY grid; anything else
    is ignored (the DHT's schema refuses it on honest nodes; a foreign node may still hand it over)."""
    return frozenset(
        value for value in values if type(value) is int and 0 <= value <= MAX_STEP and value % REPAIR_GRANULARITY == 0
    )


class RepairRequests:
    """This peer's view of the swarm's repair requests and its own: ``request`` stores one, ``refresh`` starts a read
    in the background, ``due`` says whether an epoch has a requested parameter round."""

    def __init__(self, dht, experiment_prefix: str, subkey: bytes):
        self.dht, self.key, self.subkey = dht, repairs_key(experiment_prefix), subkey
        self.requested: int | None = None  # this peer's own request, if any
        self.known: frozenset[int] = frozenset()
        self._reading = None

    def request(self, swarm_epoch: int, in_reach: bool = False, reason: str = "catching_up") -> int:
        """Ask for a parameter round at ``repair_epoch(swarm_epoch, in_reach)``; returns that epoch. ``reason``:
        ``catching_up`` (a newcomer's old state) or ``left_apart`` (a round this peer missed, or one that averaged some
        of its values with no one)."""
        epoch = repair_epoch(swarm_epoch, in_reach)
        self.requested = epoch
        self.dht.store(
            self.key,
            epoch,
            expiration_time=get_dht_time() + REQUEST_TTL_S,
            subkey=self.subkey,
            return_future=True,
        )
        logger.info("Asked the swarm for a parameter round at epoch %d (%s at %d)", epoch, reason, swarm_epoch)
        events.emit("repair_requested", epoch=epoch, global_epoch=swarm_epoch, reason=reason)
        return epoch

    def refresh(self) -> None:
        """Start reading the swarm's requests unless a read is under way; ``due`` takes its result when it is done."""
        if self._reading is None:
            self._reading = self.dht.get(self.key, latest=True, return_future=True)

    def _take_read(self) -> None:
        reading = self._reading
        if reading is None or not reading.done():
            return
        self._reading = None
        try:
            found = reading.result()
        except Exception as e:  # a failed read leaves the last one's view: the next refresh tries again
            logger.debug("Reading the repair requests failed: %r", e)
            return
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        self.known = honoured_epochs(getattr(entry, "value", None) for entry in entries.values())

    def due(self, epoch: int) -> bool:
        """Whether a parameter round was requested for the start of ``epoch`` (by this peer or one it has read)."""
        self._take_read()
        return epoch in self.known or epoch == self.requested
