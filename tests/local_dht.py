"""Real hivemind DHT nodes on 127.0.0.1 for tests, and averagers on them."""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence

import hivemind
import torch
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.utils import MSGPackSerializer

from collab.hivemind_fixes import FixedDecentralizedAverager
from trainer.local import wait_until


@contextlib.contextmanager
def two_dhts(
    record_validators: Sequence[RecordValidatorBase] = (),
    second_validators: Sequence[RecordValidatorBase] = (),
    **dht_kwargs,
) -> Iterator[tuple[hivemind.DHT, hivemind.DHT]]:
    """Two DHT nodes on 127.0.0.1, the second joined to the first and given ``second_validators`` too, both built with
    ``dht_kwargs``; shut down afterwards."""
    first = hivemind.DHT(
        start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=record_validators, **dht_kwargs
    )
    try:
        second = hivemind.DHT(
            start=True,
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            initial_peers=first.get_visible_maddrs(),
            record_validators=[*record_validators, *second_validators],
            **dht_kwargs,
        )
        try:
            yield first, second
        finally:
            second.shutdown()
    finally:
        first.shutdown()


def average_parameters_once(averagers: Sequence[TrainingStateAverager]) -> None:
    """One parameter round of ``averagers`` together (hivemind's TrainingStateAverager.step, as the optimizer calls
    it at an epoch's end)."""
    with concurrent.futures.ThreadPoolExecutor(len(averagers)) as pool:
        rounds = [
            pool.submit(averager.step, averaging_round=True, averaging_opts=dict(timeout=30)) for averager in averagers
        ]
        for done in rounds:
            done.result(timeout=60)


STALE_TEST_MATCHMAKING = 1.0  # seconds: a triggered round still looking 2.5 s later is given up


def matched_averager(
    dht: hivemind.DHT,
    value: float,
    prefix: str,
    averager_class: type = FixedDecentralizedAverager,
    next_chunk_timeout: float = 8.0,
) -> DecentralizedAverager:
    """An averager of 1000 values equal to ``value`` that looks for a group of two."""
    return averager_class(
        [torch.full((1000,), value)],
        dht=dht,
        prefix=prefix,
        target_group_size=2,
        min_matchmaking_time=STALE_TEST_MATCHMAKING,
        request_timeout=0.5,
        next_chunk_timeout=next_chunk_timeout,
        start=True,
    )


def steps_matched_in_advance(
    averagers: Sequence[DecentralizedAverager],
    tries: int = 3,
    patience: float = 12.0,
    schedule: Callable[[DecentralizedAverager], StepControl] | None = None,
    **step_kwargs,
) -> list[StepControl]:
    """One step of each averager, all in one group and waiting for their triggers (``require_trigger``; ``schedule``
    makes each step where given, as ``GradientAverager.schedule_step`` does for a gradient round). A try not
    matched within ``patience`` seconds, or in which a step ended, is cancelled for all and made again: on a loaded
    machine a follower whose leader answers after ``request_timeout`` leaves while the leader counts it, and then the
    leader waits for its trigger in a group without it while the follower looks for a group until its step's deadline
    (a pair matches in about ``min_matchmaking_time`` otherwise). What the tests time starts after the match, so a new
    try changes none of their figures; after ``tries`` the last try's stages are raised."""
    outcomes: list[str] = []
    for _ in range(tries):
        if schedule is None:
            controls = [averager.step(require_trigger=True, wait=False, **step_kwargs) for averager in averagers]
        else:
            controls = [schedule(averager) for averager in averagers]

        def matched() -> bool:
            return all(control.stage == AveragingStage.AWAITING_TRIGGER for control in controls)  # noqa: B023

        with contextlib.suppress(TimeoutError):
            wait_until(lambda: matched() or any(c.done() for c in controls), patience, "a match", poll=0.1)  # noqa: B023
        if matched():
            return controls
        outcomes = [step_outcome(control) for control in controls]
        for control in controls:
            control.cancel()
        wait_until(lambda: all(c.done() for c in controls), patience, "the unmatched steps to end")  # noqa: B023
    raise AssertionError(f"no group formed in advance in {tries} tries; the last: {outcomes}")


def step_outcome(control: StepControl) -> str:
    """A step's stage while it runs, else how it ended."""
    if not control.done():
        return control.stage.name
    if control.cancelled():
        return "cancelled"
    return repr(control.exception()) if control.exception() else "returned"


class SlowRecords(RecordValidatorBase):
    """A DHT node that takes ``delay`` seconds to sign or validate a record of one of ``keys``, blocking its event loop
    meanwhile, as the DHT process of a peer starved of CPU does
    (docs/benchmarks/2026-11-27-amd-epyc-2core-matchmaking-window.md has the measured calls)."""

    def __init__(self, keys: Sequence[str], delay: float):
        self.key_ids = {DHTID.generate(source=key).to_bytes() for key in keys}
        self.delay = delay

    def _wait(self, record: DHTRecord) -> None:
        if record.key in self.key_ids:
            time.sleep(self.delay)

    def validate(self, record: DHTRecord) -> bool:
        self._wait(record)
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        self._wait(record)
        return record.value


class SlowWithdrawals(SlowRecords):
    """A DHT node that takes ``delay`` seconds to sign a withdrawal (an averager's declaration stored as no longer
    looking for a group) under one of ``keys``, blocking its event loop meanwhile; other records pass at once."""

    def validate(self, record: DHTRecord) -> bool:
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        if MSGPackSerializer.loads(record.value) is False:
            self._wait(record)
        return record.value
