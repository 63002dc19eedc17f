"""collab.shared_average's pure parts: the value a reducer keeps for its own part, and a reply read as a difference.
Real rounds: tests/unit/test_compression.py (the wire averagers) and tests/unit/test_lowcomm.py (the optimizer's)."""

from __future__ import annotations

import pytest
import torch
from hivemind.compression import CompressionInfo, deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import averaging_pb2

from collab.compression import DENSE_BELOW_VALUES, Blockwise8BitWire, EightBitWire, SparseFloat16Wire
from collab.shared_average import reply_as_difference, shared_form

pytestmark = pytest.mark.light


def test_a_reducer_keeps_what_its_groupmates_decode_from_its_reply():
    generator = torch.Generator().manual_seed(12)
    matrix, vector = torch.randn(DENSE_BELOW_VALUES, generator=generator), torch.randn(100, generator=generator)
    matrix_info = CompressionInfo.from_tensor(matrix.view(256, -1))
    vector_info = CompressionInfo.from_tensor(vector)
    quantized = shared_form(matrix, EightBitWire(), matrix_info)
    wire = Blockwise8BitWire()
    assert torch.equal(quantized, wire.extract(wire.compress(matrix, matrix_info)))
    assert 0 < (quantized - matrix).abs().max() <= matrix.abs().max() / 127  # within one 8-bit step, not exact
    assert torch.equal(shared_form(vector, EightBitWire(), vector_info), vector.half().float())  # vectors go fp16
    assert torch.equal(shared_form(vector, SparseFloat16Wire(), vector_info), vector.half().float())


def test_a_shared_reply_becomes_the_difference_from_this_peers_own_exact_part():
    average, own = torch.tensor([1.0, 2.0, -3.0]), torch.tensor([0.5, 2.5, 1.0])
    reply = averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialize_torch_tensor(average))
    difference = deserialize_torch_tensor(reply_as_difference(reply, own).tensor_part)
    assert torch.equal(difference, torch.tensor([0.5, -0.5, -4.0]))
    assert torch.equal(own + difference, average)


def test_an_error_or_a_reply_of_the_wrong_size_is_left_for_hivemind_to_refuse():
    error = averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)
    assert reply_as_difference(error, torch.zeros(3)) is error
    wrong = averaging_pb2.AveragingData(
        code=averaging_pb2.AVERAGED_PART, tensor_part=serialize_torch_tensor(torch.zeros(4))
    )
    assert reply_as_difference(wrong, torch.zeros(3)) is wrong
