"""The collaboration's state at a glance, as a pure function of the peers' metric records and the time."""

from __future__ import annotations

import heapq
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from arguments import MetricsArguments
from collab.schema import LocalMetrics, honest_step, parse_metrics, peer_fingerprint

# Peers in each report (the most samples first) and peers remembered (the most recently seen): a swarm with churn,
# or a stranger with many keys, meets ever more keys, and neither the report nor the monitor's memory may grow with it.
MAX_CONTRIBUTORS_REPORTED = 100
MAX_CONTRIBUTORS_TRACKED = 10_000


@dataclass(frozen=True)
class SwarmMetrics:
    """One line of the monitor's report; ``loss`` is None when no peer has reported a mini-step yet."""

    step: int
    loss: float | None
    alive_peers: int
    samples: int
    samples_per_second: float
    time: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def live_metrics(records: Mapping[Any, tuple[Any, float]], now: float) -> dict[Any, LocalMetrics]:
    """Valid, unexpired records by peer; malformed, non-finite or expired ones are dropped, never raised."""
    alive = {}
    for peer, record in records.items():
        try:
            value, expiration_time = record
            if not expiration_time > now:
                continue
        except (TypeError, ValueError):
            continue
        metrics = parse_metrics(value)
        if metrics is not None:
            alive[peer] = metrics
    return alive


def with_live_progress(alive: Mapping[Any, LocalMetrics], progressing: Collection[Any]) -> dict[Any, LocalMetrics]:
    """The records of the peers in ``progressing``, those whose training-progress record has not expired: a running
    peer stores it at least every half ``metadata_expiration`` (a minute by default) however long its epochs, so a
    peer that left drops out within a minute, where its metrics record lives ``statistics_expiration`` (ten). All of
    ``alive`` when no progress record is in sight (a monitor that reads none must still report)."""
    live = {peer: metrics for peer, metrics in alive.items() if peer in progressing}
    return live or dict(alive)


def far_ahead(alive: Mapping[Any, LocalMetrics], step: int) -> list[Any]:
    """Peers whose records claim a step past the swarm's honest ``step``: left out of every sum."""
    return [peer for peer, metrics in alive.items() if metrics.step > step]


def aggregate(
    records: Mapping[Any, tuple[Any, float]], now: float, step_lag: int = MetricsArguments.alive_step_lag
) -> SwarmMetrics | None:
    """Σ loss / Σ mini_steps, alive peers, samples and samples/s over live records; None when there are none.

    ``records`` maps each peer (its public key) to ``(value, expiration_time)``, as ``collab.schema.read_metrics``
    returns them, so one peer is counted once however many times it published.
    """
    return summarize(live_metrics(records, now), now, step_lag)


def summarize(alive: Mapping[Any, LocalMetrics], now: float, step_lag: int) -> SwarmMetrics | None:
    """``aggregate`` over parsed live records. The step is ``honest_step``; a record past it (``far_ahead``) or
    more than ``step_lag`` global epochs behind it is left out: its peer lies, died or fell behind (peers in sync
    publish every epoch), and its loss and samples/s would stay in the sums until the record expires, minutes later.
    """
    if not alive:
        return None
    step = honest_step([m.step for m in alive.values()], step_lag)
    current = [m for m in alive.values() if step - step_lag <= m.step <= step]
    mini_steps = sum(m.mini_steps for m in current)
    return SwarmMetrics(
        step=step,
        loss=sum(m.loss for m in current) / mini_steps if mini_steps else None,
        alive_peers=len(current),
        samples=sum(m.samples_accumulated for m in current),
        samples_per_second=sum(m.samples_per_second for m in current),
        time=now,
    )


@dataclass(frozen=True)
class Contribution:
    """What one peer (one public key) contributed, from its newest record the monitor saw; ``first_seen`` and
    ``last_seen`` are when the monitor first saw a record of it and when it first saw its newest one."""

    name: str | None
    samples: int
    rounds: int
    step: int
    first_seen: float
    last_seen: float


def count_contributions(
    seen: Mapping[Any, Contribution],
    alive: Mapping[Any, LocalMetrics],
    step: int,
    now: float,
    limit: int = MAX_CONTRIBUTORS_TRACKED,
) -> dict[Any, Contribution]:
    """``seen`` updated with the live records: a peer's samples and rounds are the totals of its newest record
    (``contributed_samples``, ``contributed_epochs``). A record past the swarm's ``step`` (``far_ahead``) or no newer
    than the one already counted changes nothing, so a record that lives on after its peer died does not keep it
    online. Peers no longer alive stay, up to ``limit`` of them: the most recently seen."""
    updated = dict(seen)
    for peer, metrics in alive.items():
        known = updated.get(peer)
        if metrics.step > step or (known is not None and metrics.step <= known.step):
            continue
        updated[peer] = Contribution(
            name=metrics.public_name,
            samples=metrics.contributed_samples,
            rounds=metrics.contributed_epochs,
            step=metrics.step,
            first_seen=now if known is None else known.first_seen,
            last_seen=now,
        )
    if len(updated) > limit:
        updated = dict(heapq.nlargest(limit, updated.items(), key=lambda item: item[1].last_seen))
    return updated


def top_contributors(seen: Mapping[Any, Contribution], limit: int = MAX_CONTRIBUTORS_REPORTED) -> list[dict[str, Any]]:
    """The ``limit`` peers with the most samples (then rounds), as the metrics line and the dashboard show them:
    ``peer`` (a short hash of the public key), ``name`` (or None), ``samples``, ``rounds``, ``seconds_online``
    (first to last record seen) and ``last_seen`` (the monitor's time)."""
    top = heapq.nsmallest(limit, seen.items(), key=lambda item: (-item[1].samples, -item[1].rounds, item[0]))
    return [
        {
            "peer": peer_fingerprint(peer),
            "name": contribution.name,
            "samples": contribution.samples,
            "rounds": contribution.rounds,
            "seconds_online": contribution.last_seen - contribution.first_seen,
            "last_seen": contribution.last_seen,
        }
        for peer, contribution in top
    ]


def format_line(record: Mapping[str, Any]) -> str:
    """``step 12  loss 3.412  peers 3  samples 1024  samples/s 88.1``: one line per new global step."""
    loss = "n/a" if record["loss"] is None else f"{record['loss']:.3f}"
    return (
        f"step {record['step']}  loss {loss}  peers {record['alive_peers']}  samples {record['samples']}  "
        f"samples/s {record['samples_per_second']:.1f}"
    )
