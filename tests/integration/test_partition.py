"""A network partition, where the machine allows network namespaces (root and `ip netns`).

Two peers, each in its own network namespace, joined by a veth link: they train together, the link is cut for
CUT_SECONDS (each side keeps training on its own and their epochs drift apart), the link comes back, and they
converge back to one global epoch and average together again. Skipped with the reason where namespaces are not
available.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid

import pytest

from trainer.local import PeerProcess, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.scenario, pytest.mark.timeout(600)]

CUT_SECONDS = 25
SETTINGS = [
    "--target_batch_size",
    "64",
    "--matchmaking_time",
    "2",
    "--averaging_timeout",
    "10",
    "--metadata_expiration",
    "10",
    "--statistics_expiration",
    "30",
]


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts():
    """Namespaces A (10.78.0.1) and B (10.78.0.2) joined by a veth pair; removed afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's `ip`")
    tag = uuid.uuid4().hex[:6]
    names = {"A": f"cpa{tag}", "B": f"cpb{tag}"}
    links = {"A": f"va{tag}", "B": f"vb{tag}"}
    if ip("netns", "add", names["A"]).returncode != 0:
        pytest.skip(f"`ip netns add` is not allowed here: {ip('netns', 'add', names['A']).stderr.strip()}")
    try:
        commands = [
            ("netns", "add", names["B"]),
            ("link", "add", links["A"], "type", "veth", "peer", "name", links["B"]),
            ("link", "set", links["A"], "netns", names["A"]),
            ("link", "set", links["B"], "netns", names["B"]),
        ]
        for side, address in (("A", "10.78.0.1/24"), ("B", "10.78.0.2/24")):
            commands += [
                ("-n", names[side], "addr", "add", address, "dev", links[side]),
                ("-n", names[side], "link", "set", links[side], "up"),
                ("-n", names[side], "link", "set", "lo", "up"),
            ]
        for command in commands:
            done = ip(*command)
            assert done.returncode == 0, f"ip {' '.join(command)}: {done.stderr}"
        yield names, links
    finally:
        for name in names.values():
            ip("netns", "del", name)


def rounds_together(peer) -> int:
    """Gradient rounds this peer averaged with the other one."""
    return peer.averaging_group_sizes().count(2)


def test_partitioned_peers_keep_training_and_converge_after_rejoining(two_hosts, tmp_path, sample_data):
    names, links = two_hosts
    prefix = f"partition{int(time.time())}"
    common = ["--experiment_prefix", prefix, *SETTINGS]
    a = PeerProcess(
        [*common, "--host_maddrs", "/ip4/10.78.0.1/tcp/0", "--output_dir", str(tmp_path / "A")],
        tmp_path / "A.log",
        prefix=("ip", "netns", "exec", names["A"]),
    )
    peers = [a]
    try:
        join = a.join_flags(timeout=120)
        b = PeerProcess(
            [*common, *join, "--host_maddrs", "/ip4/10.78.0.2/tcp/0", "--output_dir", str(tmp_path / "B")],
            tmp_path / "B.log",
            prefix=("ip", "netns", "exec", names["B"]),
        )
        peers.append(b)
        wait_until(
            lambda: all(rounds_together(p) >= 2 for p in peers),
            180,
            "the two peers to average together",
        )
        before = [p.latest_epoch() for p in peers]

        assert ip("-n", names["A"], "link", "set", links["A"], "down").returncode == 0
        cut_at = time.monotonic()
        wait_until(
            lambda: all(p.latest_epoch() >= e + 2 for p, e in zip(peers, before, strict=True)),
            CUT_SECONDS + 60,
            "both sides to keep training while cut apart",
        )
        wait_until(lambda: time.monotonic() - cut_at >= CUT_SECONDS, CUT_SECONDS + 5, "the end of the cut", poll=1)
        during = [p.latest_epoch() for p in peers]
        offsets = [rounds_together(p) for p in peers]  # only rounds after the rejoin count
        assert ip("-n", names["A"], "link", "set", links["A"], "up").returncode == 0

        def converged() -> bool:
            epochs = [p.latest_epoch() for p in peers]
            return epochs[0] == epochs[1] and all(
                rounds_together(p) - o >= 2 for p, o in zip(peers, offsets, strict=True)
            )

        wait_until(converged, 150, "one global epoch and averaging together again after the rejoin")
        assert all(p.process.poll() is None for p in peers), "a peer died during the partition"
    finally:
        codes = [p.stop() for p in peers]
    assert all(e > b for e, b in zip(during, before, strict=True))
    assert codes == [0, 0]
