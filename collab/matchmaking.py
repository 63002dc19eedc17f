"""Averaging rounds that meet only rounds of their own epoch.

hivemind's matchmaking pairs any two rounds of one averager that look for a group at the same time, whatever epoch
each was for. A peer whose round of epoch e is late (it joined or restarted, its loop was slow) then meets the others'
round of epoch e+1, averages its gradients with theirs, and every later round of it meets the next epoch's too: the
peer stays one epoch out of step to the end, and its updates differ from the swarm's.

A gradient averager with a ``round_epoch`` source (``FiniteGradientAverager``) puts its round's epoch into the data
that hivemind gathers at matchmaking (``round_gather``), and a leader refuses a follower whose round names another
epoch (``EpochMatchmaking``), so the late round finds no group and the stale-round watchdog gives it up. A round that
names no epoch (plain hivemind peers, parameter rounds, benchmarks) meets any other, as in hivemind. A join request
whose gathered data cannot be read is refused: hivemind would fail the whole group's round on it later.

hivemind holds a peer's next round back until its previous one stops looking for a group, and a round that its
owner cancels may look on for its whole timeout (``looking_until_cancelled``). A late round with no
groupmate in sight when the next epoch's round is ready steps aside (``steps_aside``): else it would keep the next
round from meeting the others' too, and the peer would miss every round after. A late round that is leading or
following a group goes on: in a large swarm on busy machines such rounds still form, one epoch late.

A declaration window that outlasts the DHT's round trip. A would-be leader declares itself in the DHT for
``min_matchmaking_time`` and the others must look it up and ask to join before that time is over. Where a DHT call
takes longer than that (a busy machine, long round trips; figures in
docs/benchmarks/2026-11-27-amd-epyc-2core-matchmaking-window.md) the declaration has expired before anyone can read
it, every lookup finds no group and no round forms. Each averager times its own DHT calls and
declares for ``matchmaking_window`` (``MatchmakingWindow``): the configured time, or ``DHT_ROUND_TRIP_MARGIN`` times
its recent store plus lookup time when that is longer.

A group's all-reduce that starts a DHT store late on one side. hivemind withdraws a round's declaration once its
group is assembled and waits for that DHT store before the round starts its all-reduce. Where the DHT is slow, one
groupmate starts seconds after the other, whose ``sender_timeout`` runs out first, and both keep their own values
for the parts they exchange. The withdrawal is stored in the background (``TimedGroupKeyManager``): stored late it
changes nothing, since it names its declaration's expiration and a round's next declaration names a later one. The
averager's next round declares itself and asks leaders only once it is stored (for at most the matchmaking window):
otherwise two peers starting their next rounds together each read the other's previous, still looking declaration,
take it for an earlier leader and ask it to join; each holds its join lock while it waits, both requests time out,
then each accepts the other's abandoned request and runs an all-reduce with a groupmate that is not there.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Iterable

from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time, get_logger
from hivemind.utils.asyncio import cancel_and_wait
from hivemind.utils.mpfuture import MPFuture

from collab import events
from collab.schema import MAX_STEP

logger = get_logger(__name__)

ROUND_EPOCH = "round_epoch"  # the key of a round's epoch in the data its peer gathers
PART_TIMEOUT = "part_timeout"  # the key of the sender timeout its peer would use (``collab.timeouts.part_timeout``)
SHARED_AVERAGE = "shared_average"  # true: its peer asks for one average for the group (collab.shared_average)


def round_gather(epoch: int | None, part_timeout: float | None = None, shared_average: bool = False) -> dict:
    """The data a peer gathers with its round (``DecentralizedAverager.step(gather=...)``): the round's ``epoch``
    and this peer's ``part_timeout``, each where known, and whether it asks for a shared average."""
    gather: dict = {} if epoch is None else {ROUND_EPOCH: int(epoch)}
    if part_timeout is not None:
        gather[PART_TIMEOUT] = float(part_timeout)
    if shared_average:
        gather[SHARED_AVERAGE] = True
    return gather


def gathered_user_data(data_for_gather: bytes) -> object:
    """The user data of a round's gathered data as hivemind sends it (``[bandwidth, mode, user data]``), decoded.
    Raises ValueError when the bytes, which come from another peer, cannot be read."""
    try:
        _bandwidth, _mode, user_data = MSGPackSerializer.loads(data_for_gather)
        return MSGPackSerializer.loads(user_data)
    except Exception as e:  # any decoding error
        raise ValueError(f"unreadable gathered data: {e!r}") from e


def gathered_part_timeout(data_for_gather: bytes) -> float | None:
    """The sender timeout a groupmate gathered with its round, or None where it names none or not a positive finite
    number of seconds (the bytes come from another peer; ``group_part_timeout`` caps what it may ask)."""
    try:
        gathered = gathered_user_data(data_for_gather)
    except ValueError:
        return None
    seconds = gathered.get(PART_TIMEOUT) if isinstance(gathered, dict) else None
    if type(seconds) not in (int, float) or not 0 < seconds < math.inf:
        return None
    return float(seconds)


def gathered_shared_average(data_for_gather: bytes) -> bool:
    """Whether a groupmate asked for a shared average in the data it gathered (False where the data cannot be read)."""
    try:
        gathered = gathered_user_data(data_for_gather)
    except ValueError:
        return False
    return isinstance(gathered, dict) and gathered.get(SHARED_AVERAGE) is True


def gathered_round_epoch(data_for_gather: bytes) -> int | None:
    """The epoch named by a round's gathered data (``gathered_user_data``); None when the user data names none. Raises
    ValueError when the data cannot be read or the epoch is not a step number (0 to ``MAX_STEP``)."""
    gathered = gathered_user_data(data_for_gather)
    if not isinstance(gathered, dict) or ROUND_EPOCH not in gathered:
        return None
    epoch = gathered[ROUND_EPOCH]
    if type(epoch) is not int or not 0 <= epoch <= MAX_STEP:
        raise ValueError(f"{ROUND_EPOCH} {epoch!r} is not an epoch")
    return epoch


def rounds_may_meet(leader_epoch: int | None, follower_epoch: int | None) -> bool:
    """Whether a leader's round and a follower's may average together: same epoch, or one names none."""
    return leader_epoch is None or follower_epoch is None or leader_epoch == follower_epoch


def steps_aside(looking_epoch: int | None, next_epoch: int | None, triggered: bool, has_groupmates: bool) -> bool:
    """Whether a round of ``looking_epoch`` still looking for a group gives way to this peer's round of ``next_epoch``:
    when both name an epoch, the next is later, this peer has triggered the looking one (it has nothing more to add)
    and no groupmate is in sight (it leads no follower and follows no leader)."""
    if looking_epoch is None or next_epoch is None:
        return False
    return next_epoch > looking_epoch and triggered and not has_groupmates


# A follower must see a leader's declaration stored, find it with a lookup and be answered before it expires.
DHT_ROUND_TRIP_MARGIN = 1.5
# The window follows the slowest calls of this many seconds: a machine's load changes over minutes, and a burst of
# quick lookups that find nothing (a DHT with no declaration yet) says nothing of the time to find one.
DHT_CALL_MEMORY = 60.0
WINDOW_LOG_STEP = 1.25  # a changed window is logged once it differs by this factor from the one logged last


def matchmaking_window(configured: float, store_seconds: Iterable[float], lookup_seconds: Iterable[float]) -> float:
    """Seconds a round declares itself for: ``configured`` (``min_matchmaking_time``), or ``DHT_ROUND_TRIP_MARGIN``
    times the slowest recent store plus the slowest recent lookup when that is longer (none measured yet: 0)."""
    round_trip = max(store_seconds, default=0.0) + max(lookup_seconds, default=0.0)
    return max(configured, DHT_ROUND_TRIP_MARGIN * round_trip)


class MatchmakingWindow:
    """One averager's DHT call times of the last ``DHT_CALL_MEMORY`` seconds and the window they call for
    (``matchmaking_window``)."""

    def __init__(self, configured: float):
        self.configured = configured
        self.calls: dict[str, deque[tuple[float, float]]] = {"store": deque(), "lookup": deque()}  # (when, seconds)
        self.logged = configured

    def slowest(self, kind: str) -> float:
        return max((seconds for _, seconds in self.calls[kind]), default=0.0)

    def seconds(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        for calls in self.calls.values():
            while calls and calls[0][0] < now - DHT_CALL_MEMORY:
                calls.popleft()
        return matchmaking_window(self.configured, [self.slowest("store")], [self.slowest("lookup")])

    def observe(self, kind: str, seconds: float, now: float | None = None) -> float:
        """Record one DHT call (``"store"`` or ``"lookup"``) that ended ``now`` and return the window."""
        now = time.monotonic() if now is None else now
        self.calls[kind].append((now, seconds))
        window = self.seconds(now)
        if not self.logged / WINDOW_LOG_STEP < window < self.logged * WINDOW_LOG_STEP:
            self.logged = window
            logger.info(
                f"Matchmaking window {window:.1f} s (--matchmaking_time {self.configured:g}): this peer's DHT took up "
                f"to {self.slowest('store'):.1f} s to store a declaration and {self.slowest('lookup'):.1f} s to look "
                "one up in the last minute"
            )
        return window


class TimedGroupKeyManager(GroupKeyManager):
    """hivemind's ``GroupKeyManager`` that reports how long each declaration (a DHT store) and each lookup of the
    declared averagers (a DHT get) took to ``on_call(kind, seconds)``, and that withdraws a declaration in the
    background."""

    def __init__(self, manager: GroupKeyManager, on_call):
        super().__init__(manager.dht, manager.prefix, manager.group_bits, manager.target_group_size)
        self.on_call = on_call
        self._withdrawal: asyncio.Task | None = None

    async def declare_averager(
        self, group_key: str, peer_id, expiration_time: float, looking_for_group: bool = True
    ) -> bool:
        declaring = self._timed_declaration(group_key, peer_id, expiration_time, looking_for_group)
        if not looking_for_group:  # a withdrawal: the round goes on to its all-reduce (module docstring)
            self._withdrawal = asyncio.create_task(declaring)  # held until done by the process's task factory
            return True
        return await declaring

    async def withdrawn(self, timeout: float) -> None:
        """Return once the last withdrawal is stored, or after ``timeout`` seconds (it goes on storing). Each one is
        waited for once: a store that never returns delays one round, not every round after it."""
        withdrawal, self._withdrawal = self._withdrawal, None
        if withdrawal is not None and not withdrawal.done():
            await asyncio.wait({withdrawal}, timeout=timeout)

    async def _timed_declaration(self, *args) -> bool:
        started = time.monotonic()
        try:
            return await super().declare_averager(*args)
        finally:
            self.on_call("store", time.monotonic() - started)

    async def get_averagers(self, *args, **kwargs):
        started = time.monotonic()
        try:
            return await super().get_averagers(*args, **kwargs)
        finally:
            self.on_call("lookup", time.monotonic() - started)


class EpochMatchmaking(Matchmaking):
    """hivemind's ``Matchmaking`` whose leader also refuses followers of another epoch (module docstring), with
    ``BAD_GROUP_KEY``: the follower goes on to the next potential leader, as for a group key that changed; a round
    stops looking as soon as its owner cancels it (``looking_until_cancelled``); its rounds declare themselves for
    the window the DHT's measured speed calls for (``MatchmakingWindow``)."""

    leader_asked: PeerID | None = None  # the leader this round asked to join, until it answers or the ask ends

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # groups this averager's rounds were assembled into, newest last: a round registers its group only once
        # triggered, and its groupmates' parts may come first
        self.assembled_group_ids: deque[bytes] = deque(maxlen=ASSEMBLED_GROUPS_KEPT)
        self.window = MatchmakingWindow(self.min_matchmaking_time)
        self.group_key_manager = TimedGroupKeyManager(self.group_key_manager, self._dht_call_timed)

    def _dht_call_timed(self, kind: str, seconds: float) -> None:
        # hivemind reads min_matchmaking_time at each declaration: the next one takes the new window
        self.min_matchmaking_time = self.potential_leaders.min_matchmaking_time = self.window.observe(kind, seconds)

    def _check_reasons_to_reject(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> averaging_pb2.MessageFromLeader | None:
        reason = super()._check_reasons_to_reject(request, context)
        if reason is not None:
            return reason
        try:
            follower_epoch = gathered_round_epoch(request.gather)
        except ValueError:
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        own_epoch = gathered_round_epoch(self.step_control.data_for_gather)
        if not rounds_may_meet(own_epoch, follower_epoch):
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.BAD_GROUP_KEY)
        return None

    async def look_for_group(self, step: StepControl) -> GroupInfo | None:
        """hivemind's, after cancelling a late round of this averager that ``steps_aside`` for ``step``."""
        looking = self.step_control
        if looking is not None and not looking.done():
            looking_epoch = gathered_round_epoch(looking.data_for_gather)  # this peer's own data: readable
            next_epoch = gathered_round_epoch(step.data_for_gather)
            if steps_aside(looking_epoch, next_epoch, looking.triggered, self.groupmates_in_sight()):
                logger.warning(
                    f"Gave up this peer's round of epoch {looking_epoch}, still looking for a group with no groupmate "
                    f"in sight, for its round of epoch {next_epoch}. That epoch goes on with this peer's own values"
                )
                # cancelled as by its owner: the update reaches the peer's StepControl, whose cancel then stops the
                # round here. StepControl.cancel in this process would mark the round's cancel flag first, and the
                # owner's cancel (collab.hivemind_fixes.cancel_once) would take the round for cancelled already.
                MPFuture.cancel(looking)
                late = round(get_dht_time() - looking.scheduled_time, 3)
                events.emit("round_given_up", seconds=late, reason="next_round")
        return await looking_until_cancelled(super().look_for_group(step), step)

    def groupmates_in_sight(self) -> bool:
        """Whether this peer's round has a leader, followers, or a leader it asked to join: on a slow link that
        leader's answer comes late, and the leader may already count this peer in its group."""
        return self.current_leader is not None or bool(self.current_followers) or self.leader_asked is not None

    async def leader_assemble_group(self) -> GroupInfo:
        group_info = await super().leader_assemble_group()
        self.assembled_group_ids.append(group_info.group_id)
        return group_info

    async def follower_assemble_group(self, leader: PeerID, msg: averaging_pb2.MessageFromLeader) -> GroupInfo:
        group_info = await super().follower_assemble_group(leader, msg)
        self.assembled_group_ids.append(group_info.group_id)
        return group_info

    def may_hold_group(self, group_id: bytes) -> bool:
        """Whether ``group_id`` is, or may still become, a group of this averager's: one its rounds were assembled
        into, or any while a leader it asked to join may still announce its group. Otherwise a groupmate's part for
        it is for a group this peer is not in (its ask to that leader timed out before the leader's answer came:
        the leader counts it, it does not), and the part is refused at once instead of held until the sender's
        timeout, which on a slow link is minutes."""
        return group_id in self.assembled_group_ids or self.leader_asked is not None

    async def _request_join_group(self, leader: PeerID):
        self.leader_asked = leader
        try:
            return await super()._request_join_group(leader)
        finally:
            self.leader_asked = None

    async def _request_join_potential_leaders(self, step: StepControl) -> GroupInfo:
        """hivemind's, once the previous round's withdrawal is stored (module docstring). Meanwhile a peer that asks
        this one to lead is told it has not declared (NOT_DECLARED) and goes on at once."""
        await self.group_key_manager.withdrawn(timeout=self.min_matchmaking_time)
        return await super()._request_join_potential_leaders(step)


ASSEMBLED_GROUPS_KEPT = 8
OWNER_CANCEL_GRACE = 5.0  # seconds a round its owner cancelled may take to read as cancelled in this process


async def looking_until_cancelled(looking_for_group, step: StepControl) -> GroupInfo | None:
    """``looking_for_group`` (hivemind's matchmaking of ``step``), stopped as soon as the round's owner cancels it.

    hivemind's averager stops matchmaking on the owner's cancel only if the round already reads as cancelled when the
    cancel request arrives; the owner marks it so just after sending the request, and a round that did not read so
    yet kept looking (and held the averager's next round back) for the rest of its averaging timeout."""
    looking = asyncio.ensure_future(looking_for_group)
    cancel_requested = asyncio.ensure_future(step.wait_for_cancel())
    try:
        await asyncio.wait({looking, cancel_requested}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        await cancel_and_wait(looking)
        raise
    finally:
        cancel_requested.cancel()
    if looking.done():
        return looking.result()
    await cancel_and_wait(looking)
    # hivemind's averager retries a round that does not read as cancelled yet: wait for the owner's mark
    deadline = time.monotonic() + OWNER_CANCEL_GRACE
    while not step.done() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    raise asyncio.CancelledError()
