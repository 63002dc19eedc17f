"""collab.compression: top-k with error feedback, its wire format, and real hivemind all-reduce rounds through it."""

from __future__ import annotations

import contextlib
import io
import itertools
import math
import time
from collections.abc import Iterator

import hivemind
import numpy as np
import pytest
import torch
from hivemind.compression import CompressionInfo, Float16Compression, deserialize_torch_tensor
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import get_dht_time

from bench.compression import gpt2_small_shapes, measure
from collab import events
from collab.averagers import FiniteAverager
from collab.compression import (
    CODEC_KINDS,
    DENSE_BELOW_VALUES,
    MAX_PART_VALUES,
    TOP_K_SAMPLE,
    EightBitWire,
    SparseFloat16Wire,
    Uniform8BitWire,
    WireAveragerMixin,
    as_raw_part,
    encode_reply,
    extract_wire_tensor,
    largest_magnitudes,
    make_codec,
    top_k_contribution,
)

TOP_K_VALUES = DENSE_BELOW_VALUES  # the smallest tensor that goes through top-k
WIRE = SparseFloat16Wire()


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Hundreds of rounds of small ops: on a busy shared CPU, two-thread torch ops wait on each other (20× slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def contributions_over_rounds(codec, deltas: list[torch.Tensor]) -> list[torch.Tensor]:
    """What ``codec`` contributes for tensor 0 in each round, given that round's pseudo-gradient."""
    contributions = []
    for delta in deltas:
        contribution = delta.clone()
        codec.encode_(0, contribution)
        contributions.append(contribution)
    return contributions


def held_back(codec) -> torch.Tensor:
    return codec.state_dict()["held_back"][0]


def serialized(tensor: torch.Tensor, wire=WIRE) -> runtime_pb2.Tensor:
    return wire.compress(tensor, CompressionInfo.from_tensor(tensor))


def test_a_value_left_out_of_the_first_round_is_sent_in_a_later_one():
    delta = torch.zeros(TOP_K_VALUES)
    delta[0], delta[1] = 1.0, 0.6  # one value per round: index 1 loses round 1 to index 0
    codec = make_codec("topk", topk_fraction=1 / TOP_K_VALUES)
    contributions = contributions_over_rounds(codec, [delta] * 4)
    assert contributions[0].count_nonzero() == 1 and contributions[0][0] > 0
    assert any(contribution[1] > 0 for contribution in contributions[1:])


def test_matrices_of_any_size_go_through_top_k_and_small_vectors_go_dense():
    generator = torch.Generator().manual_seed(2)
    matrix, bias = torch.randn(128, 128, generator=generator), torch.randn(128, generator=generator)
    codec, sent_matrix, sent_bias = make_codec("topk", topk_fraction=0.01), matrix.clone(), bias.clone()
    codec.encode_(0, sent_matrix)
    codec.encode_(1, sent_bias)
    assert sent_matrix.count_nonzero() == round(0.01 * matrix.numel())  # 164 of 16,384
    assert torch.equal(sent_bias, bias.half().float())


def test_with_a_constant_pseudo_gradient_the_sum_sent_approaches_rounds_times_it():
    """Sum sent + held back = R·Δ exactly each round, and what is held back stays bounded, so the sum sent per round
    tends to Δ. The bound is the steady state of top-k: a value is sent when it reaches about ‖Δ‖₁/k."""
    delta = torch.randn(TOP_K_VALUES, generator=torch.Generator().manual_seed(0))
    codec = make_codec("topk", topk_fraction=0.01)
    kept_per_round = round(0.01 * TOP_K_VALUES)
    bound = delta.numel() ** 0.5 * delta.abs().sum() / kept_per_round
    sent = torch.zeros_like(delta)
    relative_errors = []
    for rounds in range(1, 301):
        (contribution,) = contributions_over_rounds(codec, [delta])
        sent += contribution
        assert torch.allclose(sent + held_back(codec), rounds * delta, rtol=1e-5, atol=1e-3)
        assert (sent - rounds * delta).norm() <= bound
        relative_errors.append(float((sent / rounds - delta).norm() / delta.norm()))
    assert relative_errors[299] < relative_errors[74] / 2 < 0.3


def test_a_single_pseudo_gradient_is_sent_in_full_over_later_rounds_and_no_held_value_grows():
    delta = torch.randn(TOP_K_VALUES, generator=torch.Generator().manual_seed(1))
    codec = make_codec("topk", topk_fraction=0.01)
    contributions_over_rounds(codec, [delta])
    for _ in range(300):
        before = held_back(codec)
        contributions_over_rounds(codec, [torch.zeros_like(delta)])
        assert (held_back(codec).abs() <= before.abs()).all()
    assert held_back(codec).norm() < 0.05 * delta.norm()


def test_top_k_keeps_the_largest_values_with_value_bits_levels_exact_in_fp16():
    values = torch.randn(10_000, generator=torch.Generator().manual_seed(2))
    for value_bits in (1, 2, 4):
        contribution = top_k_contribution(values, 0.02, value_bits)
        kept = contribution != 0
        assert 0 < kept.sum() <= 200
        assert values[kept].abs().min() >= values.abs().topk(200).values.min()
        assert (contribution[kept].sign() == values[kept].sign()).all()
        assert contribution.abs().unique().numel() <= 2 ** (value_bits - 1) + 1  # levels and 0
        assert torch.equal(contribution.half().float(), contribution)


def sampled_positions(numel: int) -> torch.Tensor:
    """The positions ``largest_magnitudes`` samples in a tensor of ``numel`` values, drawn as it draws them."""
    return torch.randint(numel, (TOP_K_SAMPLE,), generator=torch.Generator().manual_seed(numel))


@pytest.mark.parametrize("case", ["gaussian", "ties", "sample_fooled", "small"])
def test_the_sampled_top_k_finds_what_a_full_top_k_finds(case):
    """The same magnitudes as ``abs().topk``: on a Gaussian (the sampled path), with many ties at the threshold, on
    a tensor whose sampled positions alone hold large values (too few candidates: the full top-k again), and below
    the sampled path's size."""
    numel, count = 2**21, 2**21 // 100
    values = torch.randn(numel if case != "small" else 1000, generator=torch.Generator().manual_seed(3))
    if case == "ties":
        values = values.round()  # a few dozen distinct magnitudes
    if case == "sample_fooled":
        values = torch.ones(numel)
        values[sampled_positions(numel)] = 10.0
        count = numel // 10  # more than the sample's positions
    count = min(count, values.numel() // 10)
    magnitudes, positions = largest_magnitudes(values, count)
    assert positions.unique().numel() == count and torch.equal(values[positions].abs(), magnitudes)
    expected = values.abs().topk(count).values
    assert torch.equal(magnitudes.sort(descending=True).values, expected)


def test_small_tensors_go_dense_fp16_with_the_rounding_held_back():
    delta = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    codec = make_codec("topk")
    (contribution,) = contributions_over_rounds(codec, [delta])
    assert torch.equal(contribution, delta.half().float())
    assert torch.equal(held_back(codec), delta - contribution)


def test_a_non_finite_pseudo_gradient_is_not_held_back():
    codec = make_codec("topk")
    contributions_over_rounds(codec, [torch.ones(1000)])
    poisoned = torch.full((1000,), float("nan"))
    codec.encode_(0, poisoned)
    assert torch.isfinite(poisoned).all() and torch.isfinite(held_back(codec)).all()


def test_fp16_and_8bit_codecs_send_the_pseudo_gradient_unchanged():
    for kind in ("fp16", "8bit"):
        codec, delta = make_codec(kind), torch.randn(100)
        (contribution,) = contributions_over_rounds(codec, [delta])
        assert torch.equal(contribution, delta)


def test_codec_state_round_trips_through_torch_load_weights_only():
    deltas = [torch.randn(TOP_K_VALUES, generator=torch.Generator().manual_seed(seed)) for seed in range(3)]
    original, restored = make_codec("topk"), make_codec("topk")
    contributions_over_rounds(original, deltas[:2])
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)
    restored.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    assert torch.equal(*(contributions_over_rounds(codec, deltas[2:])[0] for codec in (original, restored)))
    restored.reset()
    assert restored.state_dict()["held_back"] == {}


@pytest.mark.parametrize(
    "state",
    [{"held_back": [torch.ones(2)]}, {"held_back": {-1: torch.ones(2)}}, {"held_back": {0: torch.tensor([np.inf])}}],
)
def test_a_malformed_codec_state_is_refused(state):
    with pytest.raises(ValueError, match="codec state"):
        make_codec("topk").load_state_dict(state)


@pytest.mark.parametrize(
    ("kind", "options", "flag"),
    [
        ("zip", {}, "--pseudo_grad_compression"),
        ("topk", {"topk_fraction": 0.0}, "--topk_fraction"),
        ("topk", {"topk_fraction": 1.5}, "--topk_fraction"),
        ("topk", {"value_bits": 9}, "value_bits"),
    ],
)
def test_bad_codec_settings_name_the_setting(kind, options, flag):
    with pytest.raises(ValueError, match=flag):
        make_codec(kind, **options)


def test_the_sparse_wire_is_exact_and_about_one_percent_of_dense_fp16_a_part_and_three_a_reply():
    """A peer's top-k 1 % part travels as positions and 2-bit codes, about 10 bits a kept value (the index form
    before took 48, 3.7 % of dense); the reply, with the union of three peers' supports and a few dozen distinct
    values, about 14 bits a value (the bitmap form before took 9 %); dense input as plain fp16, byte for byte."""
    generator = torch.Generator().manual_seed(4)
    parts = [top_k_contribution(torch.randn(TOP_K_VALUES, generator=generator), 0.01, 2) for _ in range(3)]
    dense_bytes = serialized(parts[0], Float16Compression()).ByteSize()
    for part in parts:
        sent = serialized(part)
        assert sent.ByteSize() <= 0.01 * dense_bytes
        assert torch.equal(WIRE.extract(sent), part)
    reply = sum(parts) / 3 - parts[0]
    answered = serialized(reply)
    assert answered.ByteSize() <= 0.035 * dense_bytes
    assert torch.equal(WIRE.extract(answered), reply.half().float())
    dense = torch.randn(1000)
    assert serialized(dense) == serialized(dense, Float16Compression())


def test_the_8bit_wire_keeps_matrices_and_long_vectors_within_a_percent_and_small_vectors_in_fp16():
    """Per block of 256 values, 127 steps each side of 0 lose about 0.7 % of a Gaussian's norm; seeded, one draw
    each. A value within a block errs by half a step at most, and nothing is clipped."""
    wire, generator = make_codec("8bit").wire, torch.Generator().manual_seed(8)
    large, matrix, small = (torch.randn(shape, generator=generator) for shape in (TOP_K_VALUES, (128, 128), 1000))
    for tensor in (large, matrix):
        part = serialized(tensor, wire)
        assert part.compression == runtime_pb2.BLOCKWISE_8BIT
        assert len(part.buffer) == tensor.numel() * (1 + 2 / 256)
        decoded = wire.extract(part)
        assert (decoded - tensor).norm() < 0.01 * tensor.norm()
        steps = tensor.reshape(-1, 256).abs().amax(dim=1, keepdim=True) / 127
        assert ((decoded - tensor).reshape(-1, 256).abs() <= 0.51 * steps).all()
    assert torch.equal(wire.extract(serialized(small, wire)), small.half().float())


def test_the_8bit_wire_keeps_the_few_large_values_of_a_pseudo_gradient_that_uniform_8_bits_fold_away():
    """A pseudo-gradient's largest values sit in a few rows (the embeddings of frequent tokens). hivemind's uniform 8
    bits span 6 sigma of the whole tensor and send each value beyond as its end bucket's mean."""
    generator = torch.Generator().manual_seed(9)
    tensor = 1e-3 * torch.randn(512, 128, generator=generator)
    tensor[:8] *= 300  # 8 of 512 rows, 300 times the rest: most of the norm
    blockwise = make_codec("8bit").wire.extract(serialized(tensor, make_codec("8bit").wire))
    uniform = Uniform8BitWire().extract(serialized(tensor, Uniform8BitWire()))
    assert (blockwise - tensor).norm() < 0.01 * tensor.norm()
    assert (blockwise[8:] - tensor[8:]).norm() < 0.01 * tensor[8:].norm()  # the small rows keep their own scale
    assert (uniform - tensor).norm() > 0.1 * tensor.norm()


@pytest.mark.parametrize("seed", range(4))
def test_plain_hivemind_refuses_a_sparse_part_rather_than_misreading_it(seed):
    """A coded part is never 2 bytes a value: hivemind's fp16 decoder fails on its odd length or on its shape."""
    part = top_k_contribution(torch.randn(TOP_K_VALUES, generator=torch.Generator().manual_seed(seed)), 0.01, 2)
    with pytest.raises((RuntimeError, ValueError), match="shape|multiple of element size"):
        deserialize_torch_tensor(serialized(part))


def sparse_part(buffer: bytes, size: tuple[int, ...], dtype: str = "float32") -> runtime_pb2.Tensor:
    return runtime_pb2.Tensor(compression=runtime_pb2.FLOAT16, buffer=buffer, size=size, dtype=dtype)


ONE_VALUE = serialized(torch.tensor([0.0] * 99 + [1.0])).buffer  # a valid coded part of 100 values


def blockwise_part(buffer: bytes, size: tuple[int, ...], dtype: str = "float32") -> runtime_pb2.Tensor:
    return runtime_pb2.Tensor(compression=runtime_pb2.BLOCKWISE_8BIT, buffer=buffer, size=size, dtype=dtype)


@pytest.mark.parametrize(
    ("part", "message"),
    [
        (blockwise_part(bytes(2 + 100), (100,)), None),  # well formed: one block's scale, 100 values
        (blockwise_part(bytes(2 + 99), (100,)), "expected 102"),
        (blockwise_part(bytes(100), (100,)), "expected 102"),
        (blockwise_part(bytes(2 + 100), (MAX_PART_VALUES + 1,)), "more than"),
        (blockwise_part(bytes(2 + 100), (100,), dtype="object"), "dtype"),
    ],
)
def test_a_malformed_blockwise_part_is_refused(part, message):
    if message is None:
        assert torch.equal(extract_wire_tensor(part), torch.zeros(100))
        return
    with pytest.raises(ValueError, match=message):
        extract_wire_tensor(part)
    assert as_raw_part(averaging_pb2.AveragingData(tensor_part=part)).tensor_part == part


def test_plain_hivemind_refuses_a_blockwise_part_rather_than_misreading_it():
    """hivemind reads BLOCKWISE_8BIT in bitsandbytes' layout (absmax and code ahead of the values), with bitsandbytes
    where installed: either way it fails on this layout."""
    part = serialized(torch.randn(64, 64), make_codec("8bit").wire)
    assert part.compression == runtime_pb2.BLOCKWISE_8BIT
    with pytest.raises((ImportError, RuntimeError, ValueError, TypeError)):
        deserialize_torch_tensor(part)


@pytest.mark.parametrize(
    ("part", "message"),
    [
        (sparse_part(ONE_VALUE, (50,)), "a position outside the part"),
        (sparse_part(ONE_VALUE, (MAX_PART_VALUES + 1,)), "more than"),
        (sparse_part(ONE_VALUE, (100,), dtype="object"), "dtype"),
        (sparse_part(ONE_VALUE[:-1], (100,)), "do not hold the 1 values"),
        (sparse_part(b"\x07\x00\x00\x00", (100,)), "shorter than the sparse form's header"),
        (sparse_part(b"\x01" + ONE_VALUE[1:], (100,)), "expected dense fp16 or the sparse form"),
    ],
)
def test_a_malformed_sparse_part_is_refused(part, message):
    with pytest.raises(ValueError, match=message):
        extract_wire_tensor(part)
    request = averaging_pb2.AveragingData(tensor_part=part)
    assert as_raw_part(request).tensor_part == part  # left for hivemind to refuse, in its own error handling


def test_a_reply_to_an_8bit_part_is_8bit_and_to_an_fp16_part_the_smallest_fp16_form():
    delta = torch.randn(TOP_K_VALUES)
    assert encode_reply(delta, runtime_pb2.BLOCKWISE_8BIT).compression == runtime_pb2.BLOCKWISE_8BIT
    assert (extract_wire_tensor(encode_reply(delta, runtime_pb2.BLOCKWISE_8BIT)) - delta).norm() < 0.01 * delta.norm()
    # a groupmate of an earlier version sends uniform 8 bits: it is answered in them, and its parts are read
    assert encode_reply(delta, runtime_pb2.UNIFORM_8BIT).compression == runtime_pb2.UNIFORM_8BIT
    assert (extract_wire_tensor(serialized(delta, Uniform8BitWire())) - delta).norm() < 0.03 * delta.norm()
    sparse = torch.zeros(TOP_K_VALUES)
    sparse[::1000] = 1.0
    assert encode_reply(sparse, runtime_pb2.FLOAT16).ByteSize() < 1000


class WireAverager(WireAveragerMixin, FiniteAverager):
    """The trainers' averager stack on ``collab.compression``'s wire formats: hivemind's with the project's fixes
    (parts from a groupmate that registered the round before this peer wait for it, where plain hivemind refuses
    them); its runner counts the round's traffic."""


ROUND_NUMBERS = itertools.count()


class SharedWireAverager(WireAverager):
    """``WireAverager`` asking for one average for the group, as the pseudo-gradient averager does."""

    asks_shared_average = True


@pytest.fixture(scope="module")
def three_dhts() -> Iterator[list[hivemind.DHT]]:
    with contextlib.ExitStack() as stack:
        first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        stack.callback(first.shutdown)
        dhts = [first]
        for _ in range(2):
            dhts.append(
                hivemind.DHT(
                    start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs()
                )
            )
            stack.callback(dhts[-1].shutdown)
        yield dhts


def average_in_one_round(
    dhts,
    kind: str,
    contributions: list[list[torch.Tensor]],
    weights: list[float],
    client_modes: list[bool] | None = None,
    averager_classes: list[type] | None = None,
    wires: list | None = None,
):
    """One all-reduce among ``WireAverager``s (or ``averager_classes``) on ``make_codec(kind).wire`` (or each peer's
    of ``wires``), one per DHT (in client mode where ``client_modes`` says so); each peer's tensors after it."""
    options = dict(
        prefix=f"wire_{kind}_{next(ROUND_NUMBERS)}",  # each round its own keys: none left by an earlier round's peers
        target_group_size=len(dhts),
        min_group_size=len(dhts),
        min_matchmaking_time=1.0,
        # a follower whose leader answers later than this gives up while the leader counts it, and the round waits
        # next_chunk_timeout for it (tests/unit/test_averagers.py: PAIR_MATCHMAKING); 0.5 s was short of the stalls
        # of a loaded machine. hivemind wants it under min_matchmaking_time.
        request_timeout=0.9,
        # a groupmate whose all-reduce starts late (a busy machine) is waited for, not left out: without it a part
        # waited request_timeout for the group, and one left out in CI made the average 25 % off
        next_chunk_timeout=10.0,
        part_size_bytes=2**15,  # several parts per tensor, so that every peer reduces some of each
        compression=make_codec(kind).wire,
        start=True,
    )
    averagers = []
    try:
        classes = averager_classes or [WireAverager] * len(dhts)
        for dht, tensors, client_mode, averager_class, wire in zip(
            dhts, contributions, client_modes or [False] * len(dhts), classes, wires or [None] * len(dhts), strict=True
        ):
            averager = averager_class(
                [tensor.clone() for tensor in tensors],
                dht=dht,
                client_mode=client_mode,
                **{**options, "compression": wire or options["compression"]},
            )
            averagers.append(averager)
        when = get_dht_time() + 1.0
        steps = [
            averager.step(weight=w, scheduled_time=when, wait=False)
            for averager, w in zip(averagers, weights, strict=True)
        ]
        assert all(len(step.result(timeout=30)) == len(dhts) for step in steps), "not every peer in the group"
        results = []
        for averager in averagers:
            with averager.get_tensors() as tensors:
                results.append([tensor.clone() for tensor in tensors])
        return results
    finally:
        for averager in averagers:
            averager.shutdown()


def weighted_mean(contributions: list[list[torch.Tensor]], weights: list[float]) -> list[torch.Tensor]:
    return [
        sum(w * tensors[i] for w, tensors in zip(weights, contributions, strict=True)) / sum(weights) for i in range(2)
    ]


@pytest.mark.timeout(60)
def test_an_all_reduce_of_top_k_contributions_gives_their_mean_within_fp16(three_dhts):
    generator, weights = torch.Generator().manual_seed(5), [1.0, 2.0, 3.0]
    contributions = []
    for _ in range(3):
        codec, tensors = make_codec("topk"), [torch.randn(2 * TOP_K_VALUES, generator=generator), torch.randn(1000)]
        for index, tensor in enumerate(tensors):
            codec.encode_(index, tensor)
        contributions.append(tensors)
    expected = weighted_mean(contributions, weights)
    for tensors in average_in_one_round(three_dhts, "topk", contributions, weights):
        for result, mean in zip(tensors, expected, strict=True):
            assert (result - mean).abs().max() <= 2**-10 * mean.abs().max()
            assert not result[mean == 0].any()  # nothing outside the union of the contributions' supports


@pytest.mark.timeout(60)
def test_an_all_reduce_on_the_8bit_wire_gives_the_mean_within_a_few_percent(three_dhts):
    generator, weights = torch.Generator().manual_seed(6), [1.0, 1.0, 2.0]
    contributions = [[torch.randn(2 * TOP_K_VALUES, generator=generator), torch.randn(1000)] for _ in range(3)]
    expected = weighted_mean(contributions, weights)
    for tensors in average_in_one_round(three_dhts, "8bit", contributions, weights):
        assert (tensors[0] - expected[0]).norm() < 0.02 * expected[0].norm()  # the part, then the reply
        assert (tensors[1] - expected[1]).abs().max() <= 2**-9 * expected[1].abs().max()


def largest_disagreement(results: list[list[torch.Tensor]]) -> float:
    """The largest difference of any value between any peer's result and the first peer's."""
    return max(float((tensors[i] - results[0][i]).abs().max()) for tensors in results[1:] for i in range(2))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["8bit", "topk"])
def test_after_a_shared_average_round_every_peer_holds_the_same_values(three_dhts, kind):
    """hivemind's replies (the average minus each sender's part, compressed) leave each peer with its own rounding:
    the same round with ``WireAverager``s left these peers 0.050 (8-bit) and 0.0015 (top-k) apart. With every
    groupmate asking for a shared average they end alike, to the fp32 rounding of adding the average's difference to
    their own values, and still hold the mean."""
    generator, weights = torch.Generator().manual_seed(9), [1.0, 1.0, 2.0]
    contributions = []
    for _ in range(3):
        codec, tensors = make_codec(kind), [torch.randn(2 * TOP_K_VALUES, generator=generator), torch.randn(1000)]
        for index, tensor in enumerate(tensors):
            codec.encode_(index, tensor)
        contributions.append(tensors)
    expected = weighted_mean(contributions, weights)
    scale = max(float(tensor.abs().max()) for tensors in contributions for tensor in tensors)
    shared = average_in_one_round(three_dhts, kind, contributions, weights, averager_classes=[SharedWireAverager] * 3)
    assert largest_disagreement(shared) <= 4 * torch.finfo(torch.float32).eps * scale
    tolerance = 0.01 if kind == "8bit" else 2**-10  # the 8-bit wire's error on the average; fp16's rounding
    for tensors in shared:
        for result, mean in zip(tensors, expected, strict=True):
            assert (result - mean).norm() <= tolerance * mean.norm()


@pytest.mark.timeout(60)
def test_a_group_with_a_peer_that_does_not_ask_for_a_shared_average_averages_as_hivemind_does(three_dhts):
    """A groupmate of an earlier version gathers no ask: the whole group answers with differences, and every peer
    still holds the mean within the wire's error (an average read as a difference would be far off)."""
    generator, weights = torch.Generator().manual_seed(10), [1.0, 1.0, 1.0]
    contributions = [[torch.randn(2 * TOP_K_VALUES, generator=generator), torch.randn(1000)] for _ in range(3)]
    expected = weighted_mean(contributions, weights)
    classes = [SharedWireAverager, SharedWireAverager, WireAverager]
    results = average_in_one_round(three_dhts, "8bit", contributions, weights, averager_classes=classes)
    for tensors in results:
        assert (tensors[0] - expected[0]).norm() < 0.02 * expected[0].norm()
        assert (tensors[1] - expected[1]).abs().max() <= 2**-9 * expected[1].abs().max()
    assert largest_disagreement(results) > 0  # differences, each peer with its own rounding


@pytest.mark.timeout(60)
def test_a_round_on_the_8bit_wire_counts_about_one_byte_a_value_each_way(three_dhts, tmp_path):
    """Each of 3 peers sends 2/3 of its values to the reducers and 2/3 as replies, at 1 byte each: 4/3 bytes per
    value each way (plus 2 bytes of scale per 256 values). The reducer decodes parts to fp32 for hivemind's runner;
    counted there, replies and received parts would weigh 4 bytes a value (10/3 bytes per value sent)."""
    values = 8 * TOP_K_VALUES
    generator = torch.Generator().manual_seed(7)
    contributions = [[torch.randn(values, generator=generator), torch.randn(1000)] for _ in range(3)]
    events.open_event_log(tmp_path / "events.jsonl")
    try:
        average_in_one_round(three_dhts, "8bit", contributions, [1.0, 1.0, 1.0])
    finally:
        events.open_event_log(None)
    rounds = events.read_events(tmp_path / "events.jsonl", "averaged")
    assert len(rounds) == 3
    for record in rounds:
        for direction in ("bytes_sent", "bytes_received"):
            assert 1.25 * values < record[direction] < 1.5 * values, (direction, record)


@pytest.mark.timeout(60)
def test_a_peer_that_accepts_no_connections_still_averages_with_the_others(three_dhts, tmp_path):
    """A peer behind NAT or a firewall runs in client mode: it sends its parts and receives the averages over the
    connections it opens, and reduces no part itself (the scenario in its own namespace: tests/integration/
    test_relay.py, in make bench)."""
    generator = torch.Generator().manual_seed(8)
    contributions = [[torch.randn(2 * TOP_K_VALUES, generator=generator), torch.randn(1000)] for _ in range(3)]
    expected = weighted_mean(contributions, [1.0, 1.0, 1.0])
    events.open_event_log(tmp_path / "events.jsonl")
    try:
        results = average_in_one_round(
            three_dhts, "fp16", contributions, [1.0, 1.0, 1.0], client_modes=[False, False, True]
        )
    finally:
        events.open_event_log(None)
    for tensors in results:
        for result, mean in zip(tensors, expected, strict=True):
            assert (result - mean).abs().max() <= 2**-9 * mean.abs().max()
    rounds = events.read_events(tmp_path / "events.jsonl", "averaged")
    assert sorted(r["group_size"] for r in rounds) == [3, 3, 3]
    # the client reduces nothing: what it receives is the averages of its own parts, as much as it sent
    client = min(rounds, key=lambda r: r["bytes_received"])
    assert client["bytes_received"] <= 1.05 * client["bytes_sent"]
    assert all(r["bytes_received"] > 1.3 * client["bytes_received"] for r in rounds if r is not client)


class WireThatCannotEncode(EightBitWire):
    """The 8-bit wire of a peer whose every part fails to encode (as a thread of torch's did after a fork: collab.
    hivemind_fixes.rebuild_torch_thread_pool)."""

    def compress(self, tensor, info, allow_inplace=False):
        raise RuntimeError("this part cannot be encoded")


@pytest.mark.timeout(60)
def test_a_peer_whose_parts_cannot_be_encoded_does_not_hold_the_round_for_its_timeouts(three_dhts, capfd):
    """Its reducers drop it at once and average the others; it keeps its own values except its own span (averaged
    here with its own parts, which need no encoding). hivemind's stream writer kept the error to itself, and both
    sides waited for their timeouts: the reducers 10 s (next_chunk_timeout), this peer 20 s."""
    generator = torch.Generator().manual_seed(12)
    contributions = [[torch.randn(2 * TOP_K_VALUES, generator=generator), torch.randn(1000)] for _ in range(3)]
    wires = [None, None, WireThatCannotEncode()]
    started = time.monotonic()
    results = average_in_one_round(three_dhts, "8bit", contributions, [1.0, 1.0, 1.0], wires=wires)
    assert time.monotonic() - started < 8.0, "the round waited for a timeout"

    def changed_fraction(peer: int) -> float:
        pairs = zip(results[peer], contributions[peer], strict=True)
        changed = sum(int((after != before).sum()) for after, before in pairs)
        return changed / sum(tensor.numel() for tensor in contributions[peer])

    assert 0.1 < changed_fraction(2) < 0.6  # its own span only
    assert changed_fraction(0) > 0.99 and changed_fraction(1) > 0.99
    # one line for each groupmate it could send nothing, and one for each that therefore averaged nothing for it, in
    # the failing peer's log (its averager's stderr); the others lost no reducer
    err = capfd.readouterr().err
    assert err.count("could not encode a part for") == 2
    assert err.count("no averaged values from") == 2, err


def test_every_codec_kind_is_built():
    assert {make_codec(kind).kind for kind in CODEC_KINDS} == set(CODEC_KINDS)


def test_the_bench_measures_gpt2_small_and_top_k_moves_a_tenth_of_fp16s_bytes():
    assert sum(math.prod(shape) for shape in gpt2_small_shapes(12)) == 124_439_808
    shapes = [(2 * TOP_K_VALUES,), (768,)]
    fp16, topk = measure("fp16", shapes, peers=3, seed=0), measure("topk", shapes, peers=3, seed=0, topk_fraction=0.01)
    assert topk["bytes_per_param_per_round"] < 0.1 * fp16["bytes_per_param_per_round"]
    assert topk["wire_relative_error"] < 1e-3 < topk["round_relative_error"]
    three_percent = measure("topk", shapes, peers=3, seed=0, topk_fraction=0.03)
    assert three_percent["bytes_per_param_per_round"] > 2 * topk["bytes_per_param_per_round"]
