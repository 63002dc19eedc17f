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
"""

from __future__ import annotations

import asyncio
import time

from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time, get_logger
from hivemind.utils.asyncio import cancel_and_wait
from hivemind.utils.mpfuture import MPFuture

from collab import events
from collab.schema import MAX_STEP

logger = get_logger(__name__)

ROUND_EPOCH = "round_epoch"  # the key of a round's epoch in the data its peer gathers


def round_gather(epoch: int) -> dict:
    """The data a peer gathers with its round of ``epoch`` (``DecentralizedAverager.step(gather=...)``)."""
    return {ROUND_EPOCH: int(epoch)}


def gathered_round_epoch(data_for_gather: bytes) -> int | None:
    """The epoch named by a round's gathered data as hivemind sends it (``[bandwidth, mode, user data]``); None when
    the user data names none. Raises ValueError when the data cannot be read or the epoch is not a step number (0 to
    ``MAX_STEP``)."""
    try:
        _bandwidth, _mode, user_data = MSGPackSerializer.loads(data_for_gather)
        gathered = MSGPackSerializer.loads(user_data)
    except Exception as e:  # any decoding error: the bytes come from another peer
        raise ValueError(f"unreadable gathered data: {e!r}") from e
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


class EpochMatchmaking(Matchmaking):
    """hivemind's ``Matchmaking`` whose leader also refuses followers of another epoch (module docstring), with
    ``BAD_GROUP_KEY``: the follower goes on to the next potential leader, as for a group key that changed; a round
    stops looking as soon as its owner cancels it (``looking_until_cancelled``)."""

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
            groupmates = self.current_leader is not None or bool(self.current_followers)
            if steps_aside(looking_epoch, next_epoch, looking.triggered, groupmates):
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
