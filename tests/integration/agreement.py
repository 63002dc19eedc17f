"""How the integration tests compare the models that peers saved when they stopped."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file


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
