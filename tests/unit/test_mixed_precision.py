"""The mixed-precision paths GPU volunteers take: fp16 (autocast, loss scaling, unscale before clipping) and bf16
(autocast, no scaling), each through hivemind.Optimizer.

CI has no GPU, but PyTorch runs fp16 and bf16 autocast and GradScaler on CPU too, so these tests drive the trainer's
own ``train()`` on CPU against a real hivemind.Optimizer (one peer, 127.0.0.1) and compare it with the fp32 path on
the same model, data and seed.
"""

from __future__ import annotations

import pytest
import torch

from arguments import TRAINER_ARGUMENTS, TrainingArguments, parse_args
from collab.errors import ConfigError
from tests.alone_peer import STEPS, Weights, train_alone
from trainer.loop import TrainingSummary, autocast_dtype

pytestmark = pytest.mark.light

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
FP32_ONLY = TrainingArguments(fp16=False)
BF16 = TrainingArguments(fp16=False, bf16=True)


def test_fp16_applies_on_cuda_only_and_bf16_on_cpus_too():
    assert autocast_dtype(TrainingArguments(), CUDA) == torch.float16
    assert autocast_dtype(TrainingArguments(), CPU) is None
    assert autocast_dtype(FP32_ONLY, CUDA) is None
    assert autocast_dtype(BF16, CPU) == torch.bfloat16


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False),
    reason="this machine's GPU has bfloat16",
)
def test_bf16_is_refused_on_a_gpu_without_bfloat16():
    with pytest.raises(ConfigError, match=r"^--bf16: GPU cuda:0 has no bfloat16 arithmetic") as refused:
        autocast_dtype(BF16, CUDA)
    assert refused.value.field == "bf16" and "\n" not in str(refused.value)


def test_bf16_takes_the_place_of_fp16_which_is_on_by_default():
    training_args = parse_args(TRAINER_ARGUMENTS, ["--bf16"])[-1]
    assert (training_args.bf16, training_args.fp16) == (True, True)
    assert autocast_dtype(training_args, torch.device("cpu")) == torch.bfloat16
    assert autocast_dtype(parse_args(TRAINER_ARGUMENTS, [])[-1], torch.device("cpu")) is None  # fp16 needs CUDA


@pytest.fixture(scope="module")
def fp32_run() -> tuple[TrainingSummary, Weights, Weights]:
    return train_alone(None, "amp_fp32")


def update_cosine(fp32_run, other_start: Weights, other_after: Weights) -> float:
    """Cosine between the fp32 run's update of the weights and the other run's, checking both started alike."""
    _, start, fp32_after = fp32_run
    assert all(torch.equal(start[name], other_start[name]) for name in start)  # same seed, same initial model
    fp32_update = torch.cat([(fp32_after[name] - start[name]).flatten() for name in start])
    other_update = torch.cat([(other_after[name] - start[name]).flatten() for name in start])
    assert fp32_update.norm() > 0
    return float(torch.nn.functional.cosine_similarity(fp32_update, other_update, dim=0))


def assert_trained(summary: TrainingSummary, after: Weights) -> None:
    assert summary.end_epoch == STEPS and summary.rollbacks == 0
    assert summary.last_loss is not None and summary.last_loss < summary.first_loss
    assert all(torch.isfinite(param).all() for param in after.values())


@pytest.mark.timeout(240)
def test_fp16_path_takes_the_same_steps_as_fp32(fp32_run):
    fp32 = fp32_run[0]
    fp16, fp16_start, fp16_after = train_alone(torch.float16, "amp_fp16")
    assert_trained(fp32, fp32_run[2])
    assert_trained(fp16, fp16_after)
    assert fp32.skipped_batches == 0
    assert fp16.skipped_batches <= 2  # the loss scale may start too high for a batch or two, then backs off
    assert [r.mini_steps for r in fp16.reports] == [r.mini_steps for r in fp32.reports]  # the same micro-batches
    assert fp16.first_loss != fp32.first_loss  # the forward pass ran in float16

    # Same data, same Lamb steps: fp16 rounding moves the updates a little, never their direction.
    cosine = update_cosine(fp32_run, fp16_start, fp16_after)
    assert cosine > 0.99, cosine
    assert abs(fp16.last_loss / fp32.last_loss - 1) < 0.01, (fp16.last_loss, fp32.last_loss)


@pytest.mark.timeout(240)
def test_bf16_path_takes_the_same_steps_as_fp32_without_loss_scaling(fp32_run):
    fp32 = fp32_run[0]
    bf16, bf16_start, bf16_after = train_alone(autocast_dtype(BF16, CPU), "amp_bf16")
    assert_trained(bf16, bf16_after)
    assert bf16.skipped_batches == 0  # no loss scale to back off: bfloat16 has fp32's range
    assert [r.mini_steps for r in bf16.reports] == [r.mini_steps for r in fp32.reports]

    assert bf16.first_loss != fp32.first_loss  # the forward pass ran in bfloat16
    # bfloat16 keeps 8 bits of mantissa to fp16's 11; Lamb's first steps follow the gradients' signs, which its
    # rounding leaves alike (measured: cosine 1.00001)
    cosine = update_cosine(fp32_run, bf16_start, bf16_after)
    assert cosine > 0.99, cosine
    assert abs(bf16.last_loss / fp32.last_loss - 1) < 0.02, (bf16.last_loss, fp32.last_loss)
