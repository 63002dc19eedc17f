"""Processes and network namespaces for the benchmarks: every child has a deadline and is killed on exit."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

from trainer.local import LocalProcess, wait_until

ROOT = Path(__file__).resolve().parent.parent
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def Child(  # noqa: N802
    module: str,
    args: Sequence,
    log_path: Path,
    timeout: float,
    env: dict | None = None,
    netns: str | None = None,
    events_path: Path | None = None,
) -> LocalProcess:
    """``python -m MODULE ARGS`` (optionally inside a network namespace) logging to a file, killed after ``timeout``
    seconds; with ``events_path``, given ``--events_path`` too."""
    return LocalProcess(
        args,
        log_path,
        {"PYTHONUNBUFFERED": "1", **(env or {})},
        prefix=["ip", "netns", "exec", netns] if netns else [],
        module=module,
        events_path=events_path,
        timeout=timeout,
    )


@contextlib.contextmanager
def children() -> Iterator[list[LocalProcess]]:
    """A list to put children in; every one still running is stopped when the block ends, however it ends."""
    started: list[LocalProcess] = []
    try:
        yield started
    finally:
        for child in started:
            child.close()


def wait_for(condition, timeout: float, what: str, poll: float = 0.5, alive: Sequence[LocalProcess] = ()):
    """``wait_until(condition)``, with a RuntimeError as soon as one of ``alive`` fails before it holds."""

    def check():
        for child in alive:
            if not child.running() and child.process.returncode != 0:
                raise RuntimeError(f"{child.log_path.name} exited ({child.process.returncode}) before {what}")
        return condition()

    return wait_until(check, timeout, what, poll)


def read_json(path: Path):
    return json.loads(Path(path).read_text()) if Path(path).exists() else None


def read_json_lines(path: Path) -> list:
    if not Path(path).exists():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


def _tc(netns: str, device: str, rate_mbit: float, action: str = "add") -> None:
    subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            netns,
            "tc",
            "qdisc",
            action,
            "dev",
            device,
            "root",
            "tbf",
            "rate",
            f"{rate_mbit:g}mbit",
            "burst",
            "32kbit",
            "latency",
            "400ms",
        ],
        check=True,
        capture_output=True,
        timeout=20,
    )


@contextlib.contextmanager
def shaped_link(rate_mbit: float, names: tuple[str, str] = ("bench_a", "bench_b")) -> Iterator[tuple[str, str]]:
    """Two network namespaces joined by a veth pair shaped with tbf on both ends; yields their addresses.

    Deletes both namespaces (and with them the veth pair) on exit. Raises OSError where namespaces are unavailable.
    """
    addresses = ("10.77.0.1", "10.77.0.2")
    created = []
    try:
        for name in names:
            _ip("netns", "add", name)
            created.append(name)
        _ip("link", "add", "bench_va", "type", "veth", "peer", "name", "bench_vb")
        for name, device, address in zip(names, ("bench_va", "bench_vb"), addresses, strict=True):
            _ip("link", "set", device, "netns", name)
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", device)
            _ip("-n", name, "link", "set", device, "up")
            _ip("-n", name, "link", "set", "lo", "up")
            _tc(name, device, rate_mbit)
        yield addresses
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        detail = getattr(e, "stderr", b"") or b""
        raise OSError(f"network namespaces unavailable: {e} {detail.decode(errors='replace').strip()}") from None
    finally:
        with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
            _ip("link", "del", "bench_va")
        for name in created:
            with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
                _ip("netns", "del", name)


MAX_RATE_MBIT = 100_000.0


def check_rates(*rates_mbit: float) -> None:
    """ValueError unless every rate is a number of Mbit/s above 0 and at most MAX_RATE_MBIT (what tbf is given)."""
    for rate in rates_mbit:
        if not 0 < rate <= MAX_RATE_MBIT:
            raise ValueError(f"a link rate must be above 0 and at most {MAX_RATE_MBIT:g} Mbit/s, not {rate}")


class NamespacesUnavailable(OSError):
    """This machine does not let the benchmark make network namespaces, links or qdiscs (not root, no iproute2)."""


@dataclasses.dataclass(frozen=True)
class WanPeer:
    """One emulated site: its namespace, its address on the hub's subnet and its end of the link (inside netns)."""

    netns: str
    address: str
    device: str

    def listen_maddr(self, transport: str = "tcp") -> str:
        """The multiaddr a peer here listens on over ``transport`` (a key of TRANSPORTS), on any free port."""
        return TRANSPORTS[transport].format(address=self.address)


# What peers may listen on. QUIC runs over UDP with its own congestion control and stream framing, so the kernel's
# TCP counters do not see it.
TRANSPORTS = {"tcp": "/ip4/{address}/tcp/0", "quic": "/ip4/{address}/udp/0/quic-v1"}


def link_bytes(ip_json: str) -> dict[str, int]:
    """``{"tx_bytes", "rx_bytes"}`` from ``ip -j -s link show dev DEV``: the kernel's own count of the link's bytes."""
    stats = json.loads(ip_json)[0]["stats64"]
    return {"tx_bytes": int(stats["tx"]["bytes"]), "rx_bytes": int(stats["rx"]["bytes"])}


# The kernel's TCP counters a window reports per peer: a connection that stalls on a shaped link shows as
# retransmission timeouts, and one torn down mid-round (a stream that ends parts short) as resets.
TCP_COUNTERS = {
    ("Tcp", "OutSegs"): "sent_segments",
    ("Tcp", "RetransSegs"): "retransmitted_segments",
    ("Tcp", "EstabResets"): "established_resets",
    ("TcpExt", "TCPTimeouts"): "retransmission_timeouts",
}


def tcp_counters(proc_net_text: str) -> dict[str, int]:
    """TCP_COUNTERS from a namespace's ``/proc/net/snmp`` and ``/proc/net/netstat`` (concatenated): each table is a
    line of names and a line of values, both after the same ``Table:`` label."""
    tables: dict[str, list[str]] = {}
    found: dict[str, int] = {}
    for line in proc_net_text.splitlines():
        label, _, fields = line.partition(":")
        if label not in tables:
            tables[label] = fields.split()
            continue
        values = dict(zip(tables.pop(label), map(int, fields.split()), strict=True))
        for (table, name), key in TCP_COUNTERS.items():
            if table == label and name in values:
                found[key] = values[name]
    missing = sorted(set(TCP_COUNTERS.values()) - set(found))
    if missing:
        raise ValueError(f"no {', '.join(missing)} in the kernel's TCP counters")
    return found


class HubNetwork:
    """Peers in their own namespaces, each joined by a shaped veth pair to a bridge in a hub namespace."""

    def __init__(self, peers: list[WanPeer], hub: str, prefix: str):
        self.peers = peers
        self.hub = hub
        self.prefix = prefix

    def set_rates(self, upload_mbit: float, download_mbit: float) -> None:
        """Reshape every peer's link in place (``tc qdisc replace``); connections stay up."""
        for rank in range(len(self.peers)):
            self.set_peer_rate(rank, upload_mbit, download_mbit)

    def set_peer_rate(self, rank: int, upload_mbit: float, download_mbit: float) -> None:
        """Reshape one peer's link in place: its upload on its own end, its download on the hub's end."""
        check_rates(upload_mbit, download_mbit)
        _tc(self.peers[rank].netns, self.peers[rank].device, upload_mbit, "replace")
        _tc(self.hub, f"{self.prefix}_h{rank}", download_mbit, "replace")

    def counters(self) -> list[dict[str, int]]:
        """Each peer's link counters as its kernel keeps them: tx_bytes is what the peer sent, rx_bytes received."""
        return [
            link_bytes(_ip_output("-n", peer.netns, "-j", "-s", "link", "show", "dev", peer.device))
            for peer in self.peers
        ]

    def tcp_counters(self) -> list[dict[str, int]]:
        """Each peer's namespace's TCP counters (``tcp_counters``): every connection of that peer, its DHT's too."""
        return [
            tcp_counters(_ip_output("netns", "exec", peer.netns, "cat", "/proc/net/snmp", "/proc/net/netstat"))
            for peer in self.peers
        ]

    def congestion_control(self) -> str:
        """The TCP congestion control of the peers' namespaces: a new namespace takes the host's default, and one
        not in the host's ``tcp_allowed_congestion_control`` cannot be chosen inside it, so the figures name it."""
        found = {
            _ip_output("netns", "exec", peer.netns, "sysctl", "-n", "net.ipv4.tcp_congestion_control").strip()
            for peer in self.peers
        }
        return ", ".join(sorted(found))


def _ip_output(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20, text=True).stdout


@contextlib.contextmanager
def hub_network(
    peers: int, upload_mbit: float, download_mbit: float, prefix: str = "wan", subnet: str = "10.78.0"
) -> Iterator[HubNetwork]:
    """``peers`` namespaces ``{prefix}_{i}`` (address ``{subnet}.{i+1}``) joined by a bridge in ``{prefix}_hub``.

    Each peer's upload is shaped with tbf on its own end of the veth pair and its download on the hub's end, so every
    site has its own access link, as home or office peers on the internet do. The subnet exists only inside these
    namespaces. Everything is deleted on exit however the block ends (deleting a namespace deletes its links); a stale
    set of the same names, left by a killed run, is deleted first. NamespacesUnavailable where they are not allowed.
    """
    if not 2 <= peers <= 200:
        raise ValueError(f"peers must be 2 to 200, not {peers}")
    check_rates(upload_mbit, download_mbit)
    hub = f"{prefix}_hub"
    names = [f"{prefix}_{rank}" for rank in range(peers)]
    created: list[str] = []
    try:
        try:
            network = _build_hub(hub, names, upload_mbit, download_mbit, prefix, subnet, created)
        except (subprocess.CalledProcessError, FileNotFoundError) as e:
            detail = getattr(e, "stderr", b"") or b""
            detail = detail if isinstance(detail, str) else detail.decode(errors="replace")
            raise NamespacesUnavailable(f"network namespaces unavailable: {e} {detail.strip()}") from None
        yield network
    finally:
        for name in reversed(created):
            with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
                _ip("netns", "del", name)


def _build_hub(
    hub: str, names: list[str], upload_mbit: float, download_mbit: float, prefix: str, subnet: str, created: list
) -> HubNetwork:
    """Make the namespaces (each name appended to ``created`` as it exists), the bridge and the shaped links."""
    if not _has_ip():
        raise FileNotFoundError("the `ip` command (iproute2) is not installed")
    existing = {line.split()[0] for line in _ip_output("netns", "list").splitlines() if line.strip()}
    for name in [hub, *names]:
        if name in existing:
            _ip("netns", "del", name)
    for name in [hub, *names]:
        _ip("netns", "add", name)
        created.append(name)
    bridge = f"{prefix}_br"
    _ip("-n", hub, "link", "add", bridge, "type", "bridge")
    _ip("-n", hub, "link", "set", bridge, "up")
    members = []
    for rank, name in enumerate(names):
        device, hub_end = f"{prefix}_p{rank}", f"{prefix}_h{rank}"
        _ip("link", "add", device, "netns", name, "type", "veth", "peer", "name", hub_end, "netns", hub)
        _ip("-n", hub, "link", "set", hub_end, "master", bridge)
        _ip("-n", hub, "link", "set", hub_end, "up")
        address = f"{subnet}.{rank + 1}"
        _ip("-n", name, "addr", "add", f"{address}/24", "dev", device)
        _ip("-n", name, "link", "set", device, "up")
        _ip("-n", name, "link", "set", "lo", "up")
        _tc(name, device, upload_mbit)
        _tc(hub, hub_end, download_mbit)
        members.append(WanPeer(name, address, device))
    return HubNetwork(members, hub, prefix)


def _has_ip() -> bool:
    return shutil.which("ip") is not None
