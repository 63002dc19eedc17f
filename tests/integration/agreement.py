"""How the integration tests compare the models that peers saved when they stopped."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from trainer.local import LocalProcess


def saved_parameters(output_dir: Path) -> dict[str, torch.Tensor]:
    """The parameters a peer saved in its --output_dir."""
    return load_file(str(output_dir / "model.safetensors"))


def assert_parameters_agree(first: dict, second: dict, peers: str, context: str = "") -> None:
    """Every tensor of ``second`` within fp16 tolerance of ``first`` (averaging travels as fp16); the message names
    ``peers`` (e.g. "A and B"), the tensor and ``context``."""
    assert first.keys() == second.keys(), f"{peers} saved different tensors"
    for name in first:
        torch.testing.assert_close(
            second[name],
            first[name],
            atol=3e-3,
            rtol=1e-2,
            msg=lambda detail, name=name: f"{peers} differ in {name}{context}: {detail}",
        )


def assert_finite(parameters: dict, peer: str) -> None:
    """Every value of every tensor finite; the message names ``peer`` and the first tensor that is not."""
    for name, tensor in parameters.items():
        assert torch.isfinite(tensor).all(), f"{peer} saved non-finite values in {name}"


def evened_out(peer: LocalProcess, group_size: int, after_epoch: int, after_time: float = 0.0) -> bool:
    """Whether ``peer``'s latest parameter round had ``group_size`` or more peers, left nothing out (no values kept
    local, no sender dropped: docs/EVENTS.md), ended after it began epoch ``after_epoch`` and after ``after_time``
    (Unix time), and was followed by two epochs, so its parameters are in place even when hivemind applies them one
    step late. When every peer's latest round is such a round, it was the same one for all, and peers that learn no
    more (learning rate 0) then hold the same parameters. A round that left a late peer out does not count: the tests
    wait for a full one instead of hoping the last round was."""
    epoch_times = [(record["epoch"], record["time"]) for record in peer.events("epoch")]
    started = [at for epoch, at in epoch_times if epoch >= after_epoch]
    rounds = [record for record in peer.events("averaged") if record["kind"] == "parameters"]
    if not started or not rounds:
        return False
    latest = rounds[-1]
    return (
        latest["group_size"] >= group_size
        and latest["values_kept_local"] == 0
        and latest["senders_dropped"] == 0
        and latest["time"] > max(started[0], after_time)
        and sum(at > latest["time"] for _, at in epoch_times) >= 2
    )
