"""Pseudo-gradient compression for the low-communication mode: what each peer contributes, and how it travels.

A ``PseudoGradientCodec`` (one per peer, from ``make_codec``) has two halves:

- ``encode_`` turns this peer's pseudo-gradient into what it contributes this round. ``fp16`` and ``8bit`` send it
  as it is; ``topk`` (SparseLoCo-style) adds it to a held-back buffer, sends the largest ``topk_fraction`` of that
  buffer quantised to ``value_bits`` bits, and keeps the rest for later rounds (error feedback: nothing is lost,
  only delayed). Vectors under ``DENSE_BELOW_VALUES`` values (biases, norms) go dense fp16, still error-fed.
- ``wire`` is the hivemind compression the all-reduce uses for these tensors. ``SparseFloat16Wire`` sends a part
  dense in fp16 or in ``collab.sparse_form``'s coded form (Rice-coded positions, palette codes for values that
  repeat), whichever is smaller: each peer's top-k part is sparse with 4 distinct values at 2 bits, and the
  reducer's reply (average minus the sender's part) has the union of the group's supports and a few distinct
  values per groupmate.

hivemind decodes what arrives with its own per-type decoders, which know neither the sparse form nor (under numpy
2) how to read 8-bit parts. An averager that exchanges these formats must therefore put ``WireAveragerMixin`` before
its hivemind class: it decodes every part this peer receives (as a reducer and as a sender of parts) with
``extract_wire_tensor`` and encodes each reply in the form of the part it answers. A plain hivemind groupmate fails
loudly on a sparse part (its length matches no dense part), never misreads it.

Operators: at ``topk_fraction`` 0.01 and ``value_bits`` 2 a peer's parts take about 10 bits per kept value (0.7 %
of fp16's bytes) and the replies, with the group's union of supports, about 14 bits per non-zero: in all 1.5 % of
fp16's traffic in a group of 3; at the default 0.03, 3.0 % (``python -m bench.compression``). Raise
``topk_fraction`` if the loss lags the dense modes; lower it if rounds stall on the link.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Sequence
from typing import AsyncIterator  # noqa: UP035 (hivemind recognises streaming handlers by typing.AsyncIterator)

import numpy as np
import torch
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import (
    CompressionBase,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    Uniform8BitQuantization,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)
from hivemind.compression.adaptive import AdaptiveCompressionBase
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import amap_in_executor

from arguments import DEFAULT_TOPK_FRACTION
from collab import sparse_form
from collab.averaging_events import ReplyLedger, RoundTraffic
from collab.hivemind_fixes import group_wait_seconds, quantization_extract, wait_for_group

logger = logging.getLogger(__name__)

CODEC_KINDS = ("fp16", "8bit", "topk")
# Vectors under this many values (biases, norms) go dense: few bytes to save, the most sensitive values. Matrices are
# compressed whatever their size: a small model's 128 x 128 ones held most of its top-k round's bytes when they went
# dense (docs/benchmarks/2026-11-28-amd-epyc-2core-wan-control-traffic.md).
DENSE_BELOW_VALUES = 2**16
MAX_VALUE_BITS = 8
# Top-k by a sampled threshold (largest_magnitudes) from this size on; the sample's 2**16 magnitudes put the
# threshold within a few tenths of a percent of the exact quantile, so a margin of 1.5 keeps enough candidates.
SAMPLED_TOP_K_MIN_VALUES = 2**20
TOP_K_SAMPLE = 2**16
TOP_K_MARGIN = 1.5
MAX_PART_VALUES = 2**26  # a sparse part claims its own size: bound what a groupmate can make this peer allocate
QUANT_BLOCK = 256  # values per scale of Blockwise8BitWire: 2 bytes of scale per 256 of values
SCALE_ROUND_UP = 1 + 2**-7  # a bfloat16 rounding of x * SCALE_ROUND_UP is never below x
WIRE_DTYPES = {"float16": torch.float16, "float32": torch.float32, "float64": torch.float64}
FP16_MAX = torch.finfo(torch.float16).max


def goes_dense(shape: Sequence[int]) -> bool:
    """Whether ``8bit`` and ``topk`` send a pseudo-gradient of this shape dense in fp16: a vector (bias, norm) under
    DENSE_BELOW_VALUES values."""
    return len(shape) < 2 and math.prod(shape) < DENSE_BELOW_VALUES


class SparseFloat16Wire(Float16Compression):
    """fp16 on the wire, sent dense or in ``collab.sparse_form``'s coded form (positions and palette codes),
    whichever is smaller.

    Exact for values that fp16 represents (``topk`` contributions are), so sparse input keeps its zeros and support.
    A coded part is always shorter than the dense one (2 bytes per value), which is how ``extract`` tells them
    apart; it is typed FLOAT16, so parts are sized as fp16 parts (``estimate_compression_ratio``).
    """

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        dense = super().compress(tensor, info, allow_inplace=False)
        coded = sparse_form.encode(np.frombuffer(dense.buffer, dtype=np.float16), shorter_than=len(dense.buffer))
        if coded is not None:
            dense.buffer = coded
        return dense

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        shape = tuple(serialized_tensor.size)
        if math.prod(shape) > MAX_PART_VALUES:
            raise ValueError(f"wire part of shape {shape}: more than {MAX_PART_VALUES} values")
        if serialized_tensor.dtype not in WIRE_DTYPES:
            raise ValueError(f"wire part of dtype {serialized_tensor.dtype!r}: expected one of {list(WIRE_DTYPES)}")
        buffer, numel = serialized_tensor.buffer, math.prod(shape)
        if len(buffer) == 2 * numel:
            return super().extract(serialized_tensor)
        positions, values = sparse_form.decode(buffer, numel)
        result = torch.zeros(numel, dtype=torch.float32)
        result[torch.from_numpy(positions)] = torch.from_numpy(values.astype(np.float32))
        dtype = WIRE_DTYPES[serialized_tensor.dtype]
        return result.reshape(shape).to(dtype).requires_grad_(serialized_tensor.requires_grad)


class Uniform8BitWire(Uniform8BitQuantization):
    """hivemind's uniform 8-bit quantisation (256 levels over 6 sigma, bucket means as codebook), read in a way
    that works under numpy 2 whether or not ``collab.hivemind_fixes`` has patched hivemind. Decoded for groupmates
    of earlier versions; this peer sends ``Blockwise8BitWire``."""

    extract = quantization_extract


class Blockwise8BitWire(CompressionBase):
    """8-bit integers with one bfloat16 scale per block of ``QUANT_BLOCK`` values (absmax / 127): 8.06 bits a value.

    hivemind's uniform 8 bits span 6 sigma of the whole part and fold every value beyond into its end bucket's mean:
    on pseudo-gradients, whose largest values sit in a few rows (embeddings), that lost 11 % of their norm and up to
    38 % of a tensor's, and each peer rebuilt the round's average with a different error. Per block, no value is
    clipped and the error stays under half a step of its own block's scale (0.7 % of the norm on the same tensors).
    Layout of the buffer: the blocks' scales, then the values; typed BLOCKWISE_8BIT, which plain hivemind reads in
    bitsandbytes' layout and refuses (the lengths differ).
    """

    compression_type = runtime_pb2.BLOCKWISE_8BIT

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        flat = tensor.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
        blocks = torch.nn.functional.pad(flat, (0, -flat.numel() % QUANT_BLOCK)).view(-1, QUANT_BLOCK)
        # rounded up to bfloat16 (8 significant bits): no value of the block lands beyond 127 steps
        scales = (blocks.abs().amax(dim=1) * (SCALE_ROUND_UP / 127)).to(torch.bfloat16)
        steps = scales.float().clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1)
        values = blocks.div(steps).round_().clamp_(-127, 127).to(torch.int8).reshape(-1)[: flat.numel()]
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=scales.view(torch.int16).numpy().tobytes() + values.numpy().tobytes(),
            size=tensor.shape,
            dtype=str(tensor.dtype).removeprefix("torch."),
            requires_grad=tensor.requires_grad,
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        shape = tuple(serialized_tensor.size)
        numel = math.prod(shape)
        if numel > MAX_PART_VALUES:
            raise ValueError(f"wire part of shape {shape}: more than {MAX_PART_VALUES} values")
        if serialized_tensor.dtype not in WIRE_DTYPES:
            raise ValueError(f"wire part of dtype {serialized_tensor.dtype!r}: expected one of {list(WIRE_DTYPES)}")
        num_blocks = -(-numel // QUANT_BLOCK)
        buffer = serialized_tensor.buffer
        expected = 2 * num_blocks + numel
        if len(buffer) != expected:
            raise ValueError(f"blockwise 8-bit part of {numel} values: {len(buffer)} bytes, expected {expected}")
        if numel == 0:
            return torch.zeros(shape, dtype=WIRE_DTYPES[serialized_tensor.dtype])
        scales = torch.frombuffer(bytearray(buffer[: 2 * num_blocks]), dtype=torch.bfloat16).float()
        values = torch.frombuffer(bytearray(buffer[2 * num_blocks :]), dtype=torch.int8).float()
        padded = torch.nn.functional.pad(values, (0, num_blocks * QUANT_BLOCK - numel)).view(num_blocks, QUANT_BLOCK)
        result = padded.mul_(scales.unsqueeze(1)).reshape(-1)[:numel].reshape(shape)
        return result.to(WIRE_DTYPES[serialized_tensor.dtype]).requires_grad_(serialized_tensor.requires_grad)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return (1 + 2 / QUANT_BLOCK) / info.descriptor.dtype.itemsize


class EightBitWire(AdaptiveCompressionBase):
    """8 bits for every matrix and long vector, fp16 for the vectors ``goes_dense`` keeps dense (hivemind's
    ``SizeAdaptiveCompression``, which ``--grad_compression 8bit`` keeps, goes by size alone and sent a small model's
    matrices in fp16)."""

    def __init__(self):
        self.dense, self.quantized = Float16Compression(), Blockwise8BitWire()

    def choose_compression(self, info: CompressionInfo) -> CompressionBase:
        return self.dense if goes_dense(info.descriptor.size) else self.quantized

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        return extract_wire_tensor(serialized_tensor)


SPARSE_FLOAT16_WIRE, BLOCKWISE_8BIT_WIRE = SparseFloat16Wire(), Blockwise8BitWire()
WIRE_DECODERS = {
    runtime_pb2.FLOAT16: SPARSE_FLOAT16_WIRE,
    runtime_pb2.BLOCKWISE_8BIT: BLOCKWISE_8BIT_WIRE,
    runtime_pb2.UNIFORM_8BIT: Uniform8BitWire(),
}


def extract_wire_tensor(serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
    """Decode a part in any form this module's wires send; other types as hivemind decodes them."""
    decoder = WIRE_DECODERS.get(serialized_tensor.compression)
    if decoder is None:
        return deserialize_torch_tensor(serialized_tensor)
    return decoder.extract(serialized_tensor).requires_grad_(serialized_tensor.requires_grad)


def encode_reply(delta: torch.Tensor, part_type: int) -> runtime_pb2.Tensor:
    """A reducer's reply (average minus the sender's part) in the form of the part it answers, as hivemind replies;
    fp16 parts are answered in the smallest fp16 form (the average's support is the union of the senders')."""
    if part_type == runtime_pb2.FLOAT16:
        return SPARSE_FLOAT16_WIRE.compress(delta, CompressionInfo.from_tensor(delta))
    if part_type == runtime_pb2.BLOCKWISE_8BIT:
        return BLOCKWISE_8BIT_WIRE.compress(delta, CompressionInfo.from_tensor(delta))
    return serialize_torch_tensor(delta, part_type)


def as_raw_part(message: averaging_pb2.AveragingData) -> averaging_pb2.AveragingData:
    """``message`` with its tensor part re-encoded uncompressed (fp32, exact), for hivemind's own decoding. A part
    this module cannot decode is left as it came: hivemind's decoding then refuses it in its own error handling
    (the sender is dropped from the round, or the reducer's part kept local)."""
    if message.HasField("tensor_part"):
        try:
            tensor = extract_wire_tensor(message.tensor_part)
        except (ValueError, TypeError, RuntimeError, IndexError) as error:
            # at most one a part: a groupmate's malformed part, or a bug of ours, is worth a line in every log
            logger.warning("A groupmate's part could not be decoded (%r); hivemind's own decoding refuses it", error)
            return message
        raw = NoCompression().compress(tensor, CompressionInfo.from_tensor(tensor))
        message.tensor_part.CopyFrom(raw)
    return message


class RawPartsStub:
    """An averager's RPC stub whose all-reduce replies arrive re-encoded by ``as_raw_part``."""

    def __init__(self, stub):
        self._stub = stub

    def __getattr__(self, name: str):
        return getattr(self._stub, name)

    async def rpc_aggregate_part(self, requests, timeout: float | None = None):
        replies = await self._stub.rpc_aggregate_part(requests, timeout=timeout)
        return amap_in_executor(as_raw_part, replies)

    def wrap_wire_stub(self, wrap) -> RawPartsStub:
        """This stub with ``wrap`` applied to the stub beneath it, which sees replies in their wire form."""
        return RawPartsStub(wrap(self._stub))


class WireAveragerMixin:
    """Put before the hivemind averager class (``class A(WireAveragerMixin, FiniteGradientAverager)``): this peer
    reads every all-reduce part it receives with ``extract_wire_tensor`` and answers in ``encode_reply``'s forms.

    Needed for ``SparseFloat16Wire`` parts and, without ``collab.hivemind_fixes``, 8-bit ones. hivemind's runner
    itself is unchanged: it sees uncompressed parts, so its averaging, refusals and timeouts apply as they are.
    Its traffic counts (``TrafficCountingMixin``) would see them uncompressed too, 4 bytes a value: this class counts
    what it receives and answers as a reducer in their wire form instead (``counts_wire_bytes``), in a
    ``ReplyLedger`` per stream.
    """

    counts_wire_bytes = True

    @classmethod
    def get_stub(cls, p2p: P2P, peer: PeerID, *, namespace: str | None = None):
        return RawPartsStub(super().get_stub(p2p, peer, namespace=namespace))

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        part_types = deque()  # the wire type of each received part, in order: the reply to part i comes i-th

        ledger = None  # this stream's counts in the round's traffic, once its runner is known

        async def noting_part_types():
            nonlocal ledger
            async for request in stream:
                if ledger is None:
                    ledger = ReplyLedger(await self._round_traffic(request.group_id))
                ledger.received(request.ByteSize())
                part_types.append(request.tensor_part.compression)
                yield request

        loop = asyncio.get_running_loop()
        raw_requests = amap_in_executor(as_raw_part, noting_part_types())
        try:
            async for reply in super().rpc_aggregate_part(raw_requests, context):
                if reply.code == averaging_pb2.AVERAGED_PART:
                    if not part_types:
                        raise AllreduceException("a reply to a part that never arrived")
                    part_type = part_types.popleft()
                    delta = deserialize_torch_tensor(reply.tensor_part)  # uncompressed: no copy
                    tensor_part = await loop.run_in_executor(None, encode_reply, delta, part_type)
                    reply = averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=tensor_part)
                if ledger is not None:
                    ledger.replied(reply.ByteSize())
                yield reply
        finally:
            if ledger is not None:
                ledger.close()

    async def _round_traffic(self, group_id: bytes):
        """The ``traffic`` of the runner of ``group_id`` (a throwaway count where there is none): found as
        ``rpc_aggregate_part`` finds the runner, after the same wait for a group that is still being registered
        (``wait_for_group``)."""
        await wait_for_group(self, group_id, group_wait_seconds(self))
        future = self._running_groups.get(group_id)
        if future is None:
            return RoundTraffic()
        try:
            runner = await asyncio.shield(future)
        except Exception:  # the round failed to start: hivemind answers the sender with its error
            return RoundTraffic()
        return getattr(runner, "traffic", None) or RoundTraffic()


@torch.no_grad()
def largest_magnitudes(flat: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``count`` largest magnitudes of the vector ``flat`` and their positions, as ``flat.abs().topk(count)``.

    On large tensors a threshold read from a sample of magnitudes keeps about TOP_K_MARGIN x ``count`` candidates
    and the top-k runs among them (about 5x faster on GPT-2's embedding, one CPU thread): the same values, found
    in the whole tensor again when the sample's threshold kept too few."""
    magnitudes = flat.abs()
    numel = flat.numel()
    kept_share = TOP_K_MARGIN * count / numel
    if numel < SAMPLED_TOP_K_MIN_VALUES or kept_share > 0.5:
        return magnitudes.topk(count, sorted=False)
    generator = torch.Generator().manual_seed(numel)  # the same sample every round: no run-to-run noise
    sample = magnitudes[torch.randint(numel, (TOP_K_SAMPLE,), generator=generator).to(flat.device)]
    threshold = sample.kthvalue(TOP_K_SAMPLE - math.ceil(kept_share * TOP_K_SAMPLE)).values
    candidates = (magnitudes >= threshold).nonzero().squeeze(1)
    if candidates.numel() < count:
        return magnitudes.topk(count, sorted=False)
    values, among = magnitudes[candidates].topk(count, sorted=False)
    return values, candidates[among]


@torch.no_grad()
def top_k_contribution(held_back: torch.Tensor, fraction: float, value_bits: int) -> torch.Tensor:
    """The largest ``fraction`` of ``held_back`` by magnitude (at least one value), each as sign times one of
    ``2**(value_bits - 1)`` levels of one per-tensor scale, zeros elsewhere.

    The scale puts the kept values' mean magnitude mid-way up the levels; contributions are rounded to fp16, so the
    wire carries them exactly. Each value goes to its nearest level, 0 included (a kept value below half a level
    stays held back): no held-back value ever grows in magnitude."""
    flat = held_back.reshape(-1).float()
    count = max(1, round(fraction * flat.numel()))
    magnitudes, positions = largest_magnitudes(flat, count)
    top_level = 2 ** (value_bits - 1)
    scale = min(magnitudes.mean().item() * 2 / (top_level + 1), FP16_MAX / top_level)
    scale = torch.tensor(scale, dtype=torch.float16).item()
    contribution = torch.zeros_like(flat)
    if scale > 0:
        levels = (magnitudes / scale).round_().clamp_(max=top_level)
        contribution[positions] = (flat[positions].sign() * levels * scale).half().float()
    return contribution.reshape(held_back.shape).to(held_back.dtype)


@torch.no_grad()
def float16_contribution(held_back: torch.Tensor) -> torch.Tensor:
    """``held_back`` rounded to fp16 (what the wire would make of it), in its own dtype."""
    return held_back.clamp(-FP16_MAX, FP16_MAX).half().to(held_back.dtype)


class PseudoGradientCodec:
    """Sends each pseudo-gradient as it is, on ``wire`` (``fp16`` and ``8bit``); ``TopKCodec`` holds values back."""

    def __init__(self, kind: str, wire: CompressionBase):
        self.kind, self.wire = kind, wire

    def encode_(self, index: int, pseudo_grad: torch.Tensor) -> None:
        """In place: replace this peer's pseudo-gradient number ``index`` by what it contributes this round."""

    def reset(self) -> None:
        """Forget held-back values (after this peer reloads the swarm's state)."""

    def state_dict(self) -> dict:
        return {"kind": self.kind}

    def load_state_dict(self, state: dict) -> None:
        """Accepts any codec's state: values held back by another kind are dropped (nothing here holds values)."""


class TopKCodec(PseudoGradientCodec):
    """SparseLoCo-style top-k with error feedback (``top_k_contribution``; dense fp16 where ``goes_dense``).

    A non-finite pseudo-gradient is not added to the held-back values (they would stay non-finite for good, and
    groupmates refuse non-finite parts): that round this peer contributes what it held back, logged at WARNING."""

    def __init__(self, topk_fraction: float, value_bits: int):
        super().__init__("topk", SPARSE_FLOAT16_WIRE)
        self.topk_fraction, self.value_bits = topk_fraction, value_bits
        self._held_back: dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def encode_(self, index: int, pseudo_grad: torch.Tensor) -> None:
        held_back = self._held_back.get(index)
        if held_back is None or held_back.shape != pseudo_grad.shape:
            held_back = self._held_back[index] = torch.zeros_like(pseudo_grad, dtype=torch.float32)
        if torch.isfinite(pseudo_grad).all():
            held_back.add_(pseudo_grad.to(held_back.device))
        else:
            logger.warning("Pseudo-gradient %d is not finite: this round sends only values held back before", index)
        if goes_dense(held_back.shape):
            contribution = float16_contribution(held_back)
        else:
            contribution = top_k_contribution(held_back, self.topk_fraction, self.value_bits)
        held_back.sub_(contribution)
        pseudo_grad.copy_(contribution)

    def reset(self) -> None:
        self._held_back.clear()

    def state_dict(self) -> dict:
        return {"kind": self.kind, "held_back": {index: tensor.clone() for index, tensor in self._held_back.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Takes the held-back values of a ``topk`` state (another kind's state holds none)."""
        held_back = state.get("held_back", {})
        if not isinstance(held_back, dict):
            raise ValueError("codec state: 'held_back' must map tensor indices to tensors")
        for index, tensor in held_back.items():
            if not (isinstance(index, int) and index >= 0 and isinstance(tensor, torch.Tensor)):
                raise ValueError("codec state: 'held_back' must map non-negative integer indices to tensors")
            if not (tensor.is_floating_point() and torch.isfinite(tensor).all()):
                raise ValueError(f"codec state: held-back tensor {index} must hold finite floating-point values")
        self._held_back = {index: tensor.float().clone() for index, tensor in held_back.items()}


def make_codec(kind: str, *, topk_fraction: float = DEFAULT_TOPK_FRACTION, value_bits: int = 2) -> PseudoGradientCodec:
    """The codec for ``--pseudo_grad_compression kind``; ``topk_fraction`` and ``value_bits`` apply to ``topk``."""
    if kind not in CODEC_KINDS:
        raise ValueError(f"--pseudo_grad_compression must be one of {', '.join(CODEC_KINDS)}, got {kind!r}")
    if not 0 < topk_fraction <= 1:
        raise ValueError(f"--topk_fraction must be in (0, 1], got {topk_fraction}")
    if not (isinstance(value_bits, int) and 1 <= value_bits <= MAX_VALUE_BITS):
        raise ValueError(f"value_bits must be an integer from 1 to {MAX_VALUE_BITS}, got {value_bits!r}")
    if kind == "topk":
        return TopKCodec(topk_fraction, value_bits)
    return PseudoGradientCodec(kind, Float16Compression() if kind == "fp16" else EightBitWire())
