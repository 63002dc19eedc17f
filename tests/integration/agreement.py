"""How the integration tests compare the models that peers saved when they stopped, and the parameters the ranks of a
torchrun peer started their epochs from."""

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


def initial_parameters() -> dict[str, torch.Tensor]:
    """The parameters every peer started from: the tiny default model with the default seed."""
    from arguments import DatasetArguments, TrainingArguments
    from trainer.model import build_model, load_tokenizer

    model, _ = build_model(DatasetArguments(), load_tokenizer(DatasetArguments()), seed=TrainingArguments.seed)
    return model.state_dict()


def assert_same_trajectory(first: dict, second: dict, peers: str, fraction: float) -> None:
    """Every tensor of ``second`` closer to ``first`` than ``fraction`` of the distance ``first`` travelled from the
    initial parameters (norms; 1e-3 more for tensors that hardly move, such as attention key biases, which get no
    gradient): the two hold one model that trained, not two models that trained apart."""
    initial = initial_parameters()
    assert first.keys() == second.keys(), f"{peers} saved different tensors"
    for name in first:
        travelled = (first[name] - initial[name]).norm().item()
        apart = (second[name] - first[name]).norm().item()
        assert apart <= fraction * travelled + 1e-3, f"{peers} {apart:.4g} apart in {name}, moved {travelled:.4g}"


def assert_finite(parameters: dict, peer: str) -> None:
    """Every value of every tensor finite; the message names ``peer`` and the first tensor that is not."""
    for name, tensor in parameters.items():
        assert torch.isfinite(tensor).all(), f"{peer} saved non-finite values in {name}"


def averaged_everything(record: dict, group_size: int) -> bool:
    """Whether an ``averaged`` event's round had ``group_size`` or more peers and left nothing out: no values kept
    local, no sender dropped (docs/EVENTS.md)."""
    return record["group_size"] >= group_size and record["values_kept_local"] == 0 and record["senders_dropped"] == 0


def evened_out(peer: LocalProcess, group_size: int, after_epoch: int, after_time: float = 0.0) -> bool:
    """Whether ``peer``'s latest parameter round had ``group_size`` or more peers, left nothing out (no values kept
    local, no sender dropped: docs/EVENTS.md), ended after it began epoch ``after_epoch`` and after ``after_time``
    (Unix time), and was followed by an epoch: the round's result is applied by the time the next epoch begins, and
    the next parameter round is an epoch away (every 2nd epoch), so peers stopped now do not stop in the middle of
    it. When every peer's latest round is such a round, it was the same one for all. A round that left a late peer
    out does not count: the tests wait for a full one instead of hoping the last round was."""
    epoch_times = [(record["epoch"], record["time"]) for record in peer.events("epoch")]
    started = [at for epoch, at in epoch_times if epoch >= after_epoch]
    rounds = [record for record in peer.events("averaged") if record["kind"] == "parameters"]
    if not started or not rounds:
        return False
    latest = rounds[-1]
    return (
        averaged_everything(latest, group_size)
        and latest["time"] > max(started[0], after_time)
        and any(at > latest["time"] for _, at in epoch_times)
    )


def rank_checksums(peer: LocalProcess, rank: int) -> dict[int, str]:
    """{global epoch: parameters checksum} from rank ``rank``'s ``ranks_synced`` events."""
    return {record["epoch"]: record["checksum"] for record in peer.rank_events(rank, "ranks_synced")}


def assert_ranks_agree(peer: LocalProcess, epochs: set[int]) -> None:
    """Rank 1 of ``peer`` started each of ``epochs`` from rank 0's parameters, and those moved."""
    rank_0, rank_1 = rank_checksums(peer, 0), rank_checksums(peer, 1)
    assert all(rank_0[epoch] == rank_1[epoch] for epoch in epochs), (rank_0, rank_1)
    assert len({rank_0[epoch] for epoch in epochs}) >= 2, rank_0
