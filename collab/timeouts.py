"""Timeouts sized by the state and the link: how long an averaging round, a state download and a shutdown may take.

Fixed timeouts fit one regime: 60 s for a round and 120 s for a download suit a small model on a LAN, while one fp16
round of 100M parameters among 8 peers at 50 Mbit/s takes about a minute and a 100M-parameter state (parameters and
Lamb's two moments in fp16, 600 MB) takes 120 s at 40 Mbit/s. Here each timeout is derived from the bytes that
travel and ``--bandwidth``, never below today's defaults (the floors, right on a LAN) and never above a cap; a flag
given explicitly wins over the derived value.

``--bandwidth`` is this peer's *upload* bandwidth in Mbit/s (on most links the slower direction). The estimates
assume the groupmates and the donor have at least as much: a round's time is set by its slowest member, and a peer
knows only its own link. Each peer derives its own values; peers of one swarm should give similar ``--bandwidth``.

- A round (butterfly all-reduce, hivemind's): each of ``n`` peers sends ``(n-1)/n`` of its tensors to the other
  reducers and the averaged part it reduces back to ``n-1`` peers, so ``2(n-1)/n`` of the round's bytes leave
  through its upload. ``averaging_timeout`` gives a round ``ROUND_MARGIN`` times that after ``matchmaking_time``.
- The next chunk of a round: a sender's upload is shared among its ``n-1`` streams, so one part of
  ``PART_BYTES`` takes ``n-1`` parts' time.
- A state download: the state's bytes through the donor's upload, ``DOWNLOAD_MARGIN`` times over. Its first chunk
  may wait for the donor's parameter round to end (hivemind serves the state between rounds): ``ROUND_MARGIN`` times
  a round, within the averaging timeout and at least a chunk's time (``first_chunk_timeout``); each try whose donor
  sent nothing in that time doubles it for the next (``widened_first_chunk_timeout``).
- A matchmaking answer: a leader's answer to a follower (accepted, begin the round) travels on the link that carries
  the rounds, and waits behind a round's data in flight there; a follower that stops waiting while its leader goes
  on leaves a group whose leader waits for it a chunk timeout and averages nothing with it. hivemind waits
  ``REQUEST_TIMEOUT_FLOOR`` (its default); here at least one part's time as well (``request_timeout``), within the
  chunk timeout.
- Late groupmates: each peer starts its part of a pre-scheduled round when its own step begins, and groupmates that
  notice the epoch's end later (a slower step, a slower DHT) start later. A groupmate that starts after the sender
  timeout is dropped from the round and its values stay unaveraged. Each averager lengthens its sender timeout
  (``next_chunk_timeout``, the reducers' twice that) to ``LATE_START_MARGIN`` times the latest start of its recent
  rounds, twice over after a round that dropped a groupmate (``part_timeout``), within the round's time; a round's
  group takes the longest of its members' (``group_part_timeout``), which each gathers at matchmaking.
- A shutdown: the last background round (``shutdown_averaging_wait``), the model written at
  ``DISK_BYTES_PER_SECOND``, then hivemind's and the DHT's shutdown (``shutdown_deadline``, after which the watchdog
  forces the exit). The wait for the last round is what the deadline leaves once the loop's last step has ended,
  less the save and the teardown (``save_reserve``, ``last_round_wait``): a step that ran long costs the round, then
  the teardown, not the saved state.
- The other ranks of a torchrun peer: they wait for rank 0 through its longest step (``rank_wait_timeout``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES

from arguments import MAX_SHUTDOWN_TIMEOUT  # the flag's cap caps the derived deadline too

AVERAGING_TIMEOUT_FLOOR = 60.0  # seconds: today's default, enough for the demo's model on a LAN
LOAD_STATE_TIMEOUT_FLOOR = 120.0
REQUEST_TIMEOUT_FLOOR = 3.0  # hivemind's request_timeout, right on a LAN
SHUTDOWN_AVERAGING_WAIT_FLOOR = 10.0  # seconds a departing peer waits for its last background round, at least
SHUTDOWN_DEADLINE_FLOOR = 25.0  # seconds from the first SIGTERM to a forced exit, at least
SHUTDOWN_ALLOWANCE = 15.0  # seconds for the loop's last step and hivemind's and the DHT's shutdown
# Of that allowance, kept whatever the last step took: a cancelled last round (2 s), hivemind's shutdown and the DHT's
# (up to its 3-s grace), and the save's fixed cost, seconds on a loaded host (docs/benchmarks/, 2026-12-07)
SHUTDOWN_TEARDOWN = 12.0
MAX_AVERAGING_TIMEOUT = 3600.0  # caps: a mistyped --bandwidth 0.001 must not make a peer wait for days
MAX_NEXT_CHUNK_TIMEOUT = 600.0
MAX_LOAD_STATE_TIMEOUT = 4 * 3600.0

ROUND_MARGIN = 2.0  # hivemind's advice: averaging_timeout about twice the all-reduce time
CHUNK_MARGIN = 2.0
DOWNLOAD_MARGIN = 2.0  # a donor also trains and serves others while it sends the state
SAVE_MARGIN = 2.0
CHUNKS_PER_ROUND_TIMEOUT = 2.5  # a round waits up to twice next_chunk_timeout for results: it must fit in the round
PART_BYTES = DEFAULT_PART_SIZE_BYTES  # hivemind's all-reduce part, after compression
DISK_BYTES_PER_SECOND = 50e6  # a slow disk (an SD card, a busy HDD); an SSD writes ten times faster
FP16_BYTES = 2  # bytes per value of parameter rounds and state downloads (fp16 on the wire)

LATE_START_MARGIN = 2.0  # a sender timeout twice the latest groupmate's start in recent rounds
PART_TIMEOUT_MEMORY = 32  # rounds whose late starts the sender timeout remembers: a swarm keeps its spread

FIRST_BACKOFF = 1.0  # seconds before the second try, doubled before each later one
MAX_BACKOFF = 30.0


@dataclass(frozen=True)
class Transfers:
    """Seconds one peer needs, at its configured bandwidth, for each kind of transfer (no margins)."""

    round_seconds: float  # one averaging round's bytes through this peer's upload
    part_seconds: float  # one all-reduce part while the upload is shared among the groupmates' streams
    state_seconds: float  # the whole state a newcomer downloads
    save_seconds: float  # the model written to disk at shutdown
    how: str  # the inputs, for the start-up line


@dataclass(frozen=True)
class Timeouts:
    """The seconds a peer gives each phase (see the module docstring); ``how`` says how they were obtained."""

    averaging_timeout: float
    next_chunk_timeout: float
    load_state_timeout: float
    shutdown_averaging_wait: float
    shutdown_deadline: float
    how: str
    # A state download's first chunk: a donor serves between its parameter rounds, so a download asked during one
    # waits for a round's time (ROUND_MARGIN x round, within the averaging timeout), then tries another donor
    first_chunk_timeout: float | None = None
    request_timeout: float = REQUEST_TIMEOUT_FLOOR  # a follower's wait for its leader's answer (module docstring)
    save_reserve: float = SHUTDOWN_TEARDOWN  # of the shutdown deadline, kept after the last round: teardown and save

    def describe(self) -> str:
        """One line for the log: every value and how it was derived."""
        return (
            f"Timeouts: averaging_timeout {self.averaging_timeout:.0f} s, next_chunk_timeout "
            f"{self.next_chunk_timeout:.1f} s, request_timeout {self.request_timeout:.1f} s, load_state_timeout "
            f"{self.load_state_timeout:.0f} s, shutdown deadline {self.shutdown_deadline:.0f} s ({self.how})"
        )


def estimate_transfers(
    *,
    parameters: int,
    round_values_per_parameter: float,
    state_values_per_parameter: float,
    bytes_per_value: float,
    model_bytes: int,
    group_size: int,
    bandwidth_mbit: float,
) -> Transfers:
    """The seconds of each transfer for a model of ``parameters`` values (module docstring).

    ``round_values_per_parameter``: values per parameter in the largest averaging round (1 for gradients or
    parameters, 2 for anchors with their outer momentum); ``state_values_per_parameter``: values per parameter in
    the state a newcomer downloads (3 for parameters and Lamb's two moments); ``bytes_per_value`` on the wire (fp16:
    2); ``model_bytes``: the model as saved; ``group_size``: the peers expected in a round (at least 2);
    ``bandwidth_mbit``: this peer's upload, Mbit/s."""
    if not (parameters >= 0 and model_bytes >= 0 and group_size >= 2 and bandwidth_mbit > 0 and bytes_per_value > 0):
        raise ValueError("parameters and model_bytes >= 0, group_size >= 2, bandwidth and bytes_per_value > 0")
    if round_values_per_parameter <= 0:
        raise ValueError("round_values_per_parameter > 0")
    upload = bandwidth_mbit * 1e6 / 8  # bytes per second
    round_bytes = parameters * round_values_per_parameter * bytes_per_value
    butterfly = 2 * (group_size - 1) / group_size
    part_bytes = min(PART_BYTES * (group_size - 1), round_bytes * (group_size - 1) / group_size)
    state_bytes = parameters * state_values_per_parameter * bytes_per_value
    return Transfers(
        round_seconds=butterfly * round_bytes / upload,
        part_seconds=part_bytes / upload,
        state_seconds=state_bytes / upload,
        save_seconds=model_bytes / DISK_BYTES_PER_SECOND,
        how=(
            f"derived from {parameters / 1e6:.1f}M parameters, {round_bytes / 1e6:.0f} MB a round in groups of "
            f"{group_size}, a {state_bytes / 1e6:.0f} MB state, {bandwidth_mbit:g} Mbit/s upload (--bandwidth)"
        ),
    )


def _clamp(value: float, floor: float, cap: float) -> float:
    return min(max(value, floor), cap)


def derive_timeouts(
    transfers: Transfers,
    matchmaking_time: float,
    averaging_timeout: float | None = None,
    next_chunk_timeout: float | None = None,
    load_state_timeout: float | None = None,
    shutdown_timeout: float | None = None,
) -> Timeouts:
    """Timeouts for ``transfers``; the ones given (the flags set explicitly) are kept as they are.

    Derived: ``averaging_timeout`` = matchmaking_time + ROUND_MARGIN x round, at least CHUNKS_PER_ROUND_TIMEOUT
    chunk timeouts; ``next_chunk_timeout`` = CHUNK_MARGIN x part, at least matchmaking_time (hivemind's default)
    and under half the averaging timeout; ``load_state_timeout`` = DOWNLOAD_MARGIN x state; each between its floor
    and its cap. The shutdown waits for the last round at most ROUND_MARGIN x round (within the averaging timeout),
    then allows SHUTDOWN_ALLOWANCE and SAVE_MARGIN x the write of the model, of which SHUTDOWN_TEARDOWN and the write
    are kept for after the last round (``save_reserve``). A given ``shutdown_timeout`` is the deadline, and the last
    round may take at most half of it: the save gets the other half."""
    chunk = next_chunk_timeout
    if chunk is None:
        chunk = _clamp(CHUNK_MARGIN * transfers.part_seconds, matchmaking_time, MAX_NEXT_CHUNK_TIMEOUT)
    averaging = averaging_timeout
    if averaging is None:
        averaging = matchmaking_time + ROUND_MARGIN * transfers.round_seconds
        averaging = _clamp(
            max(averaging, CHUNKS_PER_ROUND_TIMEOUT * chunk), AVERAGING_TIMEOUT_FLOOR, MAX_AVERAGING_TIMEOUT
        )
    elif next_chunk_timeout is None:
        chunk = min(chunk, averaging / CHUNKS_PER_ROUND_TIMEOUT)
    load = load_state_timeout
    if load is None:
        load = _clamp(DOWNLOAD_MARGIN * transfers.state_seconds, LOAD_STATE_TIMEOUT_FLOOR, MAX_LOAD_STATE_TIMEOUT)
    wait = min(averaging, max(SHUTDOWN_AVERAGING_WAIT_FLOOR, ROUND_MARGIN * transfers.round_seconds))
    reserve = SHUTDOWN_TEARDOWN + SAVE_MARGIN * transfers.save_seconds
    if shutdown_timeout is None:
        deadline = _clamp(
            wait + SHUTDOWN_ALLOWANCE + SAVE_MARGIN * transfers.save_seconds,
            SHUTDOWN_DEADLINE_FLOOR,
            MAX_SHUTDOWN_TIMEOUT,
        )
    else:
        deadline, wait = shutdown_timeout, min(wait, shutdown_timeout / 2)
        reserve = min(reserve, deadline - wait)
    given = [
        name
        for name, value in (
            ("averaging_timeout", averaging_timeout),
            ("next_chunk_timeout", next_chunk_timeout),
            ("load_state_timeout", load_state_timeout),
            ("shutdown_timeout", shutdown_timeout),
        )
        if value is not None
    ]
    how = transfers.how + (f"; {', '.join(given)} as given" if given else "")
    first_chunk = min(averaging, max(chunk, ROUND_MARGIN * transfers.round_seconds))
    request = min(chunk, max(REQUEST_TIMEOUT_FLOOR, transfers.part_seconds))
    return Timeouts(averaging, chunk, load, wait, deadline, how, first_chunk, request, reserve)


def last_round_wait(timeouts: Timeouts, seconds_left: float | None) -> float:
    """Seconds a departing peer waits for its last background round: ``shutdown_averaging_wait``, cut to what the
    shutdown deadline leaves (``seconds_left``) after ``save_reserve``; None: no deadline runs (no stop signal, the
    peer reached its max_steps). The save comes first: a peer forced out before it exits non-zero without its state."""
    if seconds_left is None:
        return timeouts.shutdown_averaging_wait
    return max(0.0, min(timeouts.shutdown_averaging_wait, seconds_left - timeouts.save_reserve))


def part_timeout_need(latest_start: float, dropped: bool, timeout: float) -> float:
    """The sender timeout one round calls for: ``LATE_START_MARGIN`` times the latest start of a groupmate's part
    (seconds after this peer's), or twice the ``timeout`` it had when it dropped a groupmate (whose start it never
    saw)."""
    return 2.0 * timeout if dropped else LATE_START_MARGIN * latest_start


def part_timeout(configured: float, needs: Sequence[float], cap: float) -> float:
    """The sender timeout for the next round: the configured one (``next_chunk_timeout``), or the most that the
    recent rounds called for (``part_timeout_need``) when longer, at most ``cap``."""
    return min(cap, max([configured, *needs]))


def group_part_timeout(own: float, groupmates: Iterable[float | None], cap: float) -> float:
    """The sender timeout of one round for its whole group: the longest that a member gathered (``own`` among them;
    None: a member that named none), at most ``cap``. Every member computes the same from the same gathered data, so
    the member that has seen the latest starts sizes the round for all, and none drops a part that another waits for.
    """
    return min(cap, max([own, *(seconds for seconds in groupmates if seconds is not None)]))


def download_backoff(tries_done: int) -> float:
    """Seconds to wait before the next state download after ``tries_done`` tries: FIRST_BACKOFF after the first,
    doubled after each one more, at most MAX_BACKOFF (a swarm whose donors are all busy is not asked again at once)."""
    if tries_done <= 0:
        return 0.0
    return min(MAX_BACKOFF, FIRST_BACKOFF * 2 ** min(tries_done - 1, 32))


def widened_first_chunk_timeout(seconds: float, cap: float) -> float:
    """The wait for a donor's first chunk in the next download try, after a try whose donor sent nothing within
    ``seconds``: twice that, at most ``cap`` (the averaging timeout: a live donor serves once its parameter round
    ends). The first wait is sized by the link, but a donor's round on a loaded machine outlasts it; a dead donor
    costs one short wait this way, a busy one a few tries."""
    return max(seconds, min(cap, 2 * seconds))


def rank_wait_timeout(timeouts: Timeouts, download_tries: int) -> float:
    """Seconds the other ranks of a torchrun peer wait for rank 0 in one exchange: its longest step is a state load
    (``download_tries`` tries of ``load_state_timeout`` each, with their backoffs), then an averaging round and a
    shutdown. A rank that waits longer takes rank 0 for hung and stops the peer."""
    backoffs = sum(download_backoff(tries) for tries in range(download_tries))
    return (
        download_tries * timeouts.load_state_timeout
        + backoffs
        + timeouts.averaging_timeout
        + timeouts.shutdown_deadline
    )
