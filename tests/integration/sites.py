"""Trainers in network namespaces on bench.procs' hub: the hub or a skip with its reason, and a peer at one site."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from bench.procs import NamespacesUnavailable, hub_network
from trainer.local import MonitorProcess, PeerProcess


@contextlib.contextmanager
def hub_or_skip(peers: int, link_mbit: float, prefix: str, subnet: str) -> Iterator:
    """``peers`` namespaces on one hub, every link shaped to ``link_mbit`` each way; the test is skipped, with the
    reason, where this machine cannot make them (not root, no iproute2, no namespaces or qdiscs)."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("network namespaces need root and iproute2's `ip` and `tc`")
    try:
        with hub_network(peers, link_mbit, link_mbit, prefix=prefix, subnet=subnet) as network:
            yield network
    except NamespacesUnavailable as e:
        pytest.skip(str(e))


def peer_at(site, flags: Sequence[str], folder: Path, name: str) -> PeerProcess:
    """``run_trainer.py FLAGS`` inside ``site``'s namespace, listening on its hub address; log and model in
    ``folder``."""
    return PeerProcess(
        [*flags, "--host_maddrs", f"/ip4/{site.address}/tcp/0", "--output_dir", str(folder / name)],
        folder / f"{name}.log",
        prefix=("ip", "netns", "exec", site.netns),
    )


def monitor_at(site, flags: Sequence[str], folder: Path, name: str):
    """``run_training_monitor.py FLAGS`` inside ``site``'s namespace, listening on its hub address; log in
    ``folder``."""
    return MonitorProcess(
        [*flags, "--host_maddrs", f"/ip4/{site.address}/tcp/0"],
        folder / f"{name}.log",
        prefix=("ip", "netns", "exec", site.netns),
    )
