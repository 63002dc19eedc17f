"""collab.callback.all_finite: the per-step guard that sends a peer back to its backup."""

import math

import pytest
import torch

from collab.callback import all_finite

pytestmark = pytest.mark.light


def model_like() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(64, 32), torch.randn(32), torch.randn(1000, 8)]


# both forms: per-tensor sums (the CPU's default) and torch's fused multi-tensor norm (a GPU's)
FORMS = pytest.mark.parametrize("fused", [False, True], ids=["per_tensor", "fused"])


@FORMS
def test_finite_parameters_pass(fused):
    assert all_finite(model_like(), fused=fused)
    assert all_finite([], fused=fused)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", [0, 1, 2])
@FORMS
def test_one_non_finite_value_anywhere_fails(bad, where, fused):
    tensors = model_like()
    tensors[where].view(-1)[7] = bad
    assert not all_finite(tensors, fused=fused)


@FORMS
def test_infinities_of_both_signs_do_not_cancel(fused):
    tensors = model_like()
    tensors[2][0, 0], tensors[2][5, 1] = math.inf, -math.inf
    assert not all_finite(tensors, fused=fused)


@FORMS
def test_half_precision_values_whose_sum_overflows_fp16_are_finite(fused):
    assert all_finite([torch.full((1000,), 60000.0, dtype=torch.float16)], fused=fused)
    assert all_finite([torch.full((100, 100), 1e30)], fused=fused)


@FORMS
def test_values_past_the_float32_sums_bound_count_as_diverged(fused):
    assert not all_finite([torch.full((100, 100), 1e35)], fused=fused)
