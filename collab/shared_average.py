"""One average for the whole group: pseudo-gradient rounds after which every peer holds the same values.

hivemind's reducer answers each sender with the average minus that sender's part, compressed, and the sender adds the
reply to its own exact values. Each peer so ends a round with the average plus its own part's compression error plus
its reply's rounding: peers that agreed before a round disagree after it by about the wire's error (on the 8-bit wire,
about 1 % of the round's update), and drift apart round after round until a parameter round brings them together.

In a shared-average round the reducer answers every sender with the same encoded average (``encode_reply`` of the
average instead of the difference) and keeps for its own part what its groupmates decode from that reply
(``shared_form``); each sender turns the reply into the difference hivemind applies (the reply minus its own exact
part, ``SharedAverageStub``). After a whole round every peer holds the same values, to the fp32 rounding of that
subtraction. The error from the exact average is then the wire's error on the average, the same at every peer, where
it was each peer's own error on its difference: about as large (8-bit wire, three peers' pseudo-gradients half in
common: 0.81 % of the average's norm against 0.70 %; docs/benchmarks/2026-11-30-amd-epyc-2core-shared-average.md).

For rounds of fresh quantities only (pseudo-gradients). A parameter round keeps hivemind's differences: an absolute
fp16 reply would round the parameters themselves to fp16 at every round.

A round is shared only when every groupmate asks for it in the data it gathers at matchmaking
(``collab.matchmaking.SHARED_AVERAGE``): groupmates of earlier versions average as before, with the group.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import AsyncIterator  # noqa: UP035 (hivemind recognises streaming handlers by typing.AsyncIterator)

import torch
from hivemind.averaging.partition import BannedException
from hivemind.compression import CompressionBase, CompressionInfo, deserialize_torch_tensor, serialize_torch_tensor
from hivemind.compression.adaptive import AdaptiveCompressionBase
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aenumerate, amap_in_executor

from collab.compression import encode_reply, extract_wire_tensor


@torch.no_grad()
def shared_form(average: torch.Tensor, wire: CompressionBase, info: CompressionInfo) -> torch.Tensor:
    """What groupmates decode from this reducer's reply to a part described by ``info`` sent on ``wire``: the average
    through the reply's form (``encode_reply``) of the part's wire type."""
    chosen = wire.choose_compression(info) if isinstance(wire, AdaptiveCompressionBase) else wire
    return extract_wire_tensor(encode_reply(average, chosen.compression_type)).to(average.dtype)


@torch.no_grad()
def reply_as_difference(reply: averaging_pb2.AveragingData, own_part: torch.Tensor) -> averaging_pb2.AveragingData:
    """A shared-average reply (uncompressed, as ``RawPartsStub`` passes it on) as hivemind's runner expects it: the
    average minus this peer's exact part. Other messages (errors) pass as they are."""
    if reply.code != averaging_pb2.AVERAGED_PART:
        return reply
    average = deserialize_torch_tensor(reply.tensor_part)
    if average.shape != own_part.shape:  # a reducer's reply of the wrong size: hivemind's runner refuses it
        return reply
    difference = average - own_part
    return averaging_pb2.AveragingData(code=reply.code, tensor_part=serialize_torch_tensor(difference))


class SharedAverageStub:
    """The stub to one reducer in a shared-average round: its replies come back as differences from this peer's own
    exact parts (``own_parts``, in the order the reducer answers them)."""

    def __init__(self, stub, own_parts: Sequence[torch.Tensor]):
        self._stub, self._own_parts = stub, list(own_parts)

    def __getattr__(self, name: str):
        return getattr(self._stub, name)

    async def rpc_aggregate_part(self, requests, timeout: float | None = None):
        replies = await self._stub.rpc_aggregate_part(requests, timeout=timeout)

        def as_difference(indexed) -> averaging_pb2.AveragingData:
            index, reply = indexed
            if index >= len(self._own_parts):  # more replies than parts: left to hivemind's count to refuse
                return reply
            return reply_as_difference(reply, self._own_parts[index])

        return amap_in_executor(as_difference, aenumerate(replies))


class SharedAverageRunnerMixin:
    """Put before ``AllReduceRunner`` (after ``TrafficCountingMixin``): with ``shared_average`` the runner answers
    and reads replies as the module docstring says; without it, hivemind's runner as it is. The averager must read
    and encode the wire forms (``collab.compression.WireAveragerMixin``), which encodes the replies."""

    def __init__(self, *, shared_average: bool = False, **kwargs):
        super().__init__(**kwargs)
        if shared_average and not getattr(self._servicer_type, "counts_wire_bytes", False):
            raise ValueError("a shared-average round needs an averager with WireAveragerMixin: it encodes the replies")
        self.shared_average = shared_average

    def _own_parts_for(self, peer_index: int) -> list:
        """This peer's exact parts (and their compression infos) that the groupmate at ``peer_index`` reduces."""
        return list(self.tensor_part_container._input_parts_by_peer[peer_index])

    def _get_peer_stub(self, peer: PeerID):
        stub = super()._get_peer_stub(peer)
        if not self.shared_average:
            return stub
        own_parts = self._own_parts_for(self.ordered_peer_ids.index(peer))
        return SharedAverageStub(stub, [part for part, _info in own_parts])

    async def _communicate_with_peer(self, peer_id: PeerID):
        if not (self.shared_average and peer_id == self.peer_id):
            return await super()._communicate_with_peer(peer_id)
        # this peer's own parts: reduced here, kept as the groupmates will decode them
        peer_index, sender_index = self.ordered_peer_ids.index(peer_id), self.sender_peer_ids.index(peer_id)
        wire, loop = self.tensor_part_container.compression, asyncio.get_running_loop()
        own_parts = self._own_parts_for(peer_index)
        for part_index, (tensor_part, (_part, info)) in enumerate(
            zip(self.parts_for_local_averaging, own_parts, strict=True)
        ):
            average = await self.tensor_part_reducer.accumulate_part(
                sender_index, part_index, tensor_part, weight=self.weight
            )
            shared = await loop.run_in_executor(None, shared_form, average, wire, info)
            self.tensor_part_container.register_processed_part(peer_index, part_index, shared - tensor_part)

    def _accumulate_parts_streaming(self, stream: AsyncIterator, sender_index: int) -> AsyncIterator:
        if not self.shared_average:
            return super()._accumulate_parts_streaming(stream, sender_index)
        return self._reply_with_the_average(stream, sender_index)

    async def _reply_with_the_average(self, stream: AsyncIterator, sender_index: int) -> AsyncIterator:
        """hivemind's ``_accumulate_parts_streaming``, answering with the average itself (uncompressed: the averager's
        ``WireAveragerMixin`` encodes it in the part's wire form, the same bytes for every sender)."""
        part_index = 0
        loop = asyncio.get_running_loop()
        try:
            async for tensor_part, weight in amap_in_executor(
                lambda message: (deserialize_torch_tensor(message.tensor_part), message.weight),
                stream,
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                try:
                    average = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=weight
                    )
                    part_index += 1
                except BannedException:
                    break  # the sender was dropped: nothing more of it is averaged
                serialized = await loop.run_in_executor(None, serialize_torch_tensor, average)
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])
