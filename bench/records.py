"""Item 4: the monitor's aggregation of 10,000 peers' records, and reading 1,000 real records from the DHT."""

from __future__ import annotations

import time

from bench.formulas import median
from collab.hivemind_fixes import FixedDHT
from collab.schema import LocalMetrics


def synthetic_records(count: int, now: float) -> dict[bytes, tuple[dict, float]]:
    """``count`` valid, unexpired records as ``read_metrics`` returns them (peer key -> (value, expiration))."""
    return {
        b"[owner:peer%06d]" % i: (
            LocalMetrics(
                step=100 + i % 3,
                samples_per_second=10.0 + i % 7,
                samples_accumulated=64,
                loss=7.5 + i % 5,
                mini_steps=4,
            ).model_dump(),
            now + 600,
        )
        for i in range(count)
    }


def time_ms(function, repeats: int) -> float:
    """Median wall time of ``function()`` over ``repeats`` calls, in milliseconds."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(1000 * (time.perf_counter() - started))
    return median(times)


def aggregate_ms(count: int, repeats: int = 5) -> float:
    from monitor.aggregate import aggregate

    now = time.time()
    records = synthetic_records(count, now)
    return time_ms(lambda: aggregate(records, now), repeats)


def dht_read_ms(count: int, repeats: int = 3) -> dict:
    """Store ``count`` signed LocalMetrics records from one node, then time a second node's ``read_metrics``.

    The records go through the same validators as a trainer's (schema and RSA signature); their subkeys carry one
    owner key plus a suffix, because making 1,000 RSA keys would take longer than the measurement.
    """
    from hivemind.utils import get_dht_time

    from collab.schema import make_validators, metrics_key, read_metrics

    prefix = f"bench_records_{int(time.time())}"
    validators, public_key = make_validators(prefix)
    writer = FixedDHT(start=True, record_validators=validators)
    reader = None
    try:
        expiration = get_dht_time() + 600
        value = LocalMetrics(
            step=1, samples_per_second=10.0, samples_accumulated=64, loss=7.5, mini_steps=4
        ).model_dump()
        futures = [
            writer.store(metrics_key(prefix), value, expiration, subkey=public_key + b"#%05d" % i, return_future=True)
            for i in range(count)
        ]
        stored = sum(bool(future.result(timeout=120)) for future in futures)
        reader_validators, _ = make_validators(prefix)
        reader = FixedDHT(
            start=True,
            initial_peers=[str(m) for m in writer.get_visible_maddrs()],
            client_mode=True,
            record_validators=reader_validators,
        )
        found = []
        read = time_ms(lambda: found.append(len(read_metrics(reader, prefix))), repeats)
        return {"stored": stored, "read": max(found), "read_ms": read}
    finally:
        for dht in (reader, writer):
            if dht is not None:
                dht.shutdown()
