"""Streams between p2pd daemons on shaped links: ``python -m bench.streams [--rate_mbit R ...]``, ends with JSON.

Each of ``--peers`` hivemind.P2P peers runs in its own network namespace behind a shaped access link
(``bench.procs.hub_network``). Every round each peer opens a fresh stream to every other one, sends ``--bytes`` and
reads as many back: the butterfly all-reduce's shape (a span out, its average back) without tensors, averagers or
a DHT. An exchange that reads fewer bytes than it sent without any error is a *silent end*: the stream or its
connection was closed under it, the end that hivemind's all-reduce reports as "sent N parts, but we expected M". The
figures: exchanges, silent ends, errors and timeouts, and each namespace's TCP counters over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

from bench.procs import TRANSPORTS, Child, children, hub_network, read_json_lines, wait_for

CHUNK = 1 << 16
LENGTH_BYTES = 8
MAX_EXCHANGE_BYTES = 1 << 30  # what a handler reads at most: a stray stream cannot make it read forever
START_S = 20.0  # from launch to the first round: the peers start their daemons and connect
HANDLER = "bench_streams"
ANSWER_LINGER_S = 60.0  # an answer waits this long at most for its asker to close the stream
OUTCOMES = ("ok", "silent_end", "error", "timeout")


def outcome(record: dict) -> str:
    """An exchange's outcome: all its bytes back (ok), fewer with no error (silent_end), an error, or a timeout."""
    if record.get("timed_out"):
        return "timeout"
    if record.get("error"):
        return "error"
    return "ok" if record["received"] == record["sent"] else "silent_end"


def summarize(exchanges: list[dict]) -> dict:
    """Counts of each outcome, and the seconds the exchanges that ended took (median and most)."""
    counts = dict.fromkeys(OUTCOMES, 0)
    for record in exchanges:
        counts[outcome(record)] += 1
    seconds = [record["seconds"] for record in exchanges if outcome(record) != "timeout"]
    return {
        "exchanges": len(exchanges),
        **counts,
        "seconds_median": round(statistics.median(seconds), 3) if seconds else None,
        "seconds_max": max(seconds) if seconds else None,
    }


class Peer:
    """One peer: answers every stream with as many bytes as it read, and runs its rounds of exchanges."""

    def __init__(self, rank: int, address: str, peers: int, out: Path, t0: float, transport: str = "tcp"):
        self.rank, self.address, self.peers, self.out, self.t0 = rank, address, peers, out, t0
        self.transport = transport

    def record(self, **fields) -> None:
        with open(self.out / f"{self.rank}.jsonl", "a") as f:
            f.write(json.dumps({"rank": self.rank, "t": round(time.time() - self.t0, 3), **fields}) + "\n")

    async def answer(self, info, reader, writer) -> None:
        try:
            length = int.from_bytes(await reader.readexactly(LENGTH_BYTES), "big")
            if length > MAX_EXCHANGE_BYTES:
                raise ValueError(f"asked to read {length} bytes, more than {MAX_EXCHANGE_BYTES}")
            await reader.readexactly(length)
            await send(writer, length)
            # the asker closes once it has read everything: closing first could cut what p2pd has not sent yet
            await asyncio.wait_for(reader.read(1), ANSWER_LINGER_S)
        except Exception as e:  # the asker's end records the outcome; this end says why it stopped
            self.record(event="answer_failed", error=repr(e)[:200])
        finally:
            writer.close()

    async def exchange(self, p2p, peer_id, round_index: int, nbytes: int) -> None:
        started = time.time()
        fields = {"event": "exchange", "round": round_index, "to": peer_id.to_base58(), "sent": nbytes}
        received, error = 0, None
        try:
            _, reader, writer = await p2p.call_binary_stream_handler(peer_id, HANDLER)
            writer.write(nbytes.to_bytes(LENGTH_BYTES, "big"))
            await send(writer, nbytes)
            while received < nbytes:
                data = await reader.read(min(CHUNK, nbytes - received))
                if not data:
                    break
                received += len(data)
            writer.close()
        except Exception as e:
            error = repr(e)[:200]
        self.record(**fields, received=received, error=error, seconds=round(time.time() - started, 3))

    async def timed_exchange(self, p2p, peer_id, round_index: int, nbytes: int, timeout: float) -> None:
        try:
            await asyncio.wait_for(self.exchange(p2p, peer_id, round_index, nbytes), timeout)
        except asyncio.TimeoutError:
            self.record(
                event="exchange", round=round_index, to=peer_id.to_base58(), sent=nbytes, received=0, timed_out=True
            )

    async def run(self, rounds: int, nbytes: int, period: float, timeout: float) -> None:
        from hivemind.p2p import P2P, PeerID
        from hivemind.utils.multiaddr import Multiaddr

        p2p = await P2P.create(host_maddrs=[TRANSPORTS[self.transport].format(address=self.address)])
        await p2p.add_binary_stream_handler(HANDLER, self.answer)
        visible = [str(maddr).split("/p2p/")[0] for maddr in await p2p.get_visible_maddrs()]
        (self.out / f"{self.rank}.addr").write_text(json.dumps({"id": p2p.peer_id.to_base58(), "maddrs": visible}))
        others = []
        while len(others) < self.peers - 1:
            others = [path for path in sorted(self.out.glob("*.addr")) if path.stem != str(self.rank)]
            await asyncio.sleep(0.2)
        peer_ids = []
        for path in others:
            other = json.loads(path.read_text())
            peer_id = PeerID.from_base58(other["id"])
            if int(path.stem) < self.rank:  # one dial per pair: the higher rank dials
                await p2p._client.connect(peer_id, [Multiaddr(maddr) for maddr in other["maddrs"]])
            peer_ids.append(peer_id)
        self.record(event="ready", peer_id=p2p.peer_id.to_base58())
        for round_index in range(rounds):
            await asyncio.sleep(max(0.0, self.t0 + round_index * period - time.time()))
            await asyncio.gather(*(self.timed_exchange(p2p, i, round_index, nbytes, timeout) for i in peer_ids))
        self.record(event="done")
        (self.out / f"{self.rank}.done").touch()
        while not (self.out / "stop").exists():  # answer the others until the counters are read
            await asyncio.sleep(0.5)
        await p2p.shutdown()


async def send(writer, nbytes: int) -> None:
    payload = bytes(CHUNK)
    left = nbytes
    while left > 0:
        writer.write(payload[: min(CHUNK, left)])
        left -= min(CHUNK, left)
        await writer.drain()


def measure(args, out: Path) -> dict:
    """The peers' rounds on links shaped to ``args.rate_mbit``: the outcomes and each namespace's TCP counters."""
    out.mkdir(parents=True, exist_ok=True)
    deadline = START_S + args.rounds * (args.period + args.exchange_timeout) + 60
    with hub_network(args.peers, args.rate_mbit, args.rate_mbit, prefix="strm", subnet="10.83.0") as net:
        before = net.tcp_counters()
        t0 = time.time() + START_S
        with children() as started:
            for rank, peer in enumerate(net.peers):
                flags = ["peer", rank, peer.address, args.peers, args.rounds, args.bytes, args.period, t0, out]
                flags += [args.exchange_timeout, args.transport]
                started.append(Child("bench.streams", flags, out / f"{rank}.log", deadline, netns=peer.netns))
            wait_for(
                lambda: len(list(out.glob("*.done"))) == args.peers, deadline, "every peer's rounds", alive=started
            )
            after = net.tcp_counters()  # before the daemons close their connections
            (out / "stop").touch()
            codes = [child.wait() for child in started]
        congestion_control = net.congestion_control()
    exchanges = [record for rank in range(args.peers) for record in read_json_lines(out / f"{rank}.jsonl")]
    exchanges = [record for record in exchanges if record["event"] == "exchange"]
    return {
        "rate_mbit": args.rate_mbit,
        "peers": args.peers,
        "rounds": args.rounds,
        "bytes": args.bytes,
        "transport": args.transport,
        "congestion_control": congestion_control,
        **summarize(exchanges),
        "tcp": [{key: end[key] - start[key] for key in end} for start, end in zip(before, after, strict=True)],
        "exit_codes": codes,
    }


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, default=3, help="peers, each in its own namespace, 2 to 16 (3)")
    parser.add_argument("--rate_mbit", type=float, default=0.579, help="each link's rate, each way (0.579)")
    parser.add_argument("--rounds", type=int, default=8, help="rounds of exchanges, 1 to 1000 (8)")
    parser.add_argument("--bytes", type=int, default=667_000, help="bytes each way of one exchange (667000)")
    parser.add_argument("--period", type=float, default=0.0, help="seconds from one round's start to the next (0)")
    parser.add_argument("--exchange_timeout", type=float, default=240.0, help="seconds an exchange may take (240)")
    parser.add_argument("--transport", choices=sorted(TRANSPORTS), default="tcp", help="what the peers listen on")
    parser.add_argument("--output_dir", type=Path, default=Path("outputs/streams"), help="the peers' records")
    args = parser.parse_args(argv)
    bounds = {"peers": (2, 16), "rounds": (1, 1000), "bytes": (1, MAX_EXCHANGE_BYTES), "rate_mbit": (0.01, 10_000.0)}
    bounds |= {"period": (0.0, 3600.0), "exchange_timeout": (1.0, 3600.0)}
    for name, (low, high) in bounds.items():
        if not low <= getattr(args, name) <= high:
            parser.error(f"--{name} must be {low} to {high}, not {getattr(args, name)}")
    return args


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "peer":
        rank, address, peers, rounds, nbytes, period, t0, out, timeout, transport = argv[1:11]
        peer = Peer(int(rank), address, int(peers), Path(out), float(t0), transport)
        asyncio.run(peer.run(int(rounds), int(nbytes), float(period), float(timeout)))
        return
    args = parse_args(argv)
    print(json.dumps(measure(args, args.output_dir / time.strftime("%Y%m%d-%H%M%S"))))


if __name__ == "__main__":
    main()
