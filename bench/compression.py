"""Pseudo-gradient compression on GPT-2-small shapes: ``python -m bench.compression [--peers N] [--layers L]``.

For each kind of ``collab.compression.make_codec`` it prints, as one JSON line, the bytes one peer's link carries
per parameter in one all-reduce round (its parts sent to the other reducers plus their replies, both directions,
as hivemind's butterfly all-reduce splits them) and two relative errors of the average that peer gets:

- ``wire_relative_error``: against the exact mean of what the peers contributed (what the wire itself loses);
- ``round_relative_error``: against the mean of the peers' pseudo-gradients (for ``topk`` mostly what error feedback
  holds back for later rounds, not lost).

Pseudo-gradients are random (a shared Gaussian direction plus as much per-peer Gaussian noise), no downloads; the
figures depend on their distribution, not on training. Every part goes through the wire here (hivemind keeps the
1/N a peer reduces itself exact), so the errors are upper bounds.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Iterator

import torch
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES
from hivemind.compression import CompressionInfo

from collab.compression import CODEC_KINDS, encode_reply, extract_wire_tensor, make_codec

GPT2_SMALL = {"vocab": 50257, "positions": 1024, "width": 768, "layers": 12}


def gpt2_small_shapes(layers: int) -> list[tuple[int, ...]]:
    """Parameter shapes of GPT-2 small (124M parameters with 12 layers), embeddings included."""
    width, hidden = GPT2_SMALL["width"], 4 * GPT2_SMALL["width"]
    block = [(width,), (width,), (width, 3 * width), (3 * width,), (width, width), (width,)]
    block += [(width,), (width,), (width, hidden), (hidden,), (hidden, width), (width,)]
    embeddings = [(GPT2_SMALL["vocab"], width), (GPT2_SMALL["positions"], width)]
    return embeddings + block * layers + [(width,), (width,)]


def parts_of(tensor: torch.Tensor, index: int, wire) -> Iterator[tuple[torch.Tensor, CompressionInfo]]:
    """``tensor`` split as hivemind's ``TensorPartContainer`` splits it for ``wire``."""
    info = CompressionInfo.from_tensor(tensor, key=index)
    part_values = int(DEFAULT_PART_SIZE_BYTES / (tensor.element_size() * wire.estimate_compression_ratio(info)))
    for part_index, part in enumerate(tensor.reshape(-1).split(part_values)):
        yield part, info.get_part(part_index, part_values)


def measure(kind: str, shapes: list[tuple[int, ...]], peers: int, seed: int, **codec_options) -> dict:
    """One round of ``peers`` codecs of ``kind`` (``make_codec(kind, **codec_options)``) on random pseudo-gradients
    of ``shapes``, as seen by peer 0."""
    codecs = [make_codec(kind, **codec_options) for _ in range(peers)]
    generator = torch.Generator().manual_seed(seed)
    link_bytes = 0.0
    squared = {"wire_error": 0.0, "round_error": 0.0, "contributed_mean": 0.0, "pseudo_grad_mean": 0.0}
    for index, shape in enumerate(shapes):
        shared = torch.randn(shape, generator=generator)
        pseudo_grads = [shared + torch.randn(shape, generator=generator) for _ in range(peers)]
        contributions = [pseudo_grad.clone() for pseudo_grad in pseudo_grads]
        for codec, contribution in zip(codecs, contributions, strict=True):
            codec.encode_(index, contribution)
        wire = codecs[0].wire
        averaged = []
        per_peer_parts = [list(parts_of(contribution, index, wire)) for contribution in contributions]
        for own_parts in zip(*per_peer_parts, strict=True):
            sent = [wire.compress(part, info) for part, info in own_parts]
            mean = sum(extract_wire_tensor(message) for message in sent) / peers
            reply = encode_reply(mean - own_parts[0][0], sent[0].compression)
            averaged.append(own_parts[0][0] + extract_wire_tensor(reply))
            link_bytes += (sent[0].ByteSize() + reply.ByteSize()) * (peers - 1) / peers
        result = torch.cat(averaged).reshape(shape)
        contributed_mean, pseudo_grad_mean = sum(contributions) / peers, sum(pseudo_grads) / peers
        squared["wire_error"] += float((result - contributed_mean).square().sum())
        squared["round_error"] += float((result - pseudo_grad_mean).square().sum())
        squared["contributed_mean"] += float(contributed_mean.square().sum())
        squared["pseudo_grad_mean"] += float(pseudo_grad_mean.square().sum())
    params = sum(math.prod(shape) for shape in shapes)
    return {
        "bytes_per_param_per_round": round(link_bytes / params, 5),
        "wire_relative_error": round(math.sqrt(squared["wire_error"] / squared["contributed_mean"]), 5),
        "round_relative_error": round(math.sqrt(squared["round_error"] / squared["pseudo_grad_mean"]), 5),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.compression", description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=3, help="peers in the all-reduce group (2 to 64)")
    parser.add_argument("--layers", type=int, default=12, help="transformer blocks (GPT-2 small has 12; 1 to 48)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random pseudo-gradients")
    parser.add_argument("--topk_fraction", type=float, default=None, help="topk's kept fraction, in (0, 1]")
    args = parser.parse_args(argv)
    if not 2 <= args.peers <= 64:
        parser.error("--peers must be from 2 to 64")
    if not 1 <= args.layers <= 48:
        parser.error("--layers must be from 1 to 48")
    options = {} if args.topk_fraction is None else {"topk_fraction": args.topk_fraction}
    try:
        topk_fraction = make_codec("topk", **options).topk_fraction
    except ValueError as error:
        parser.error(str(error))
    shapes = gpt2_small_shapes(args.layers)
    started = time.monotonic()
    kinds = {kind: measure(kind, shapes, args.peers, args.seed, **options) for kind in CODEC_KINDS}
    summary = {
        "model": f"gpt2-small shapes, {args.layers} layers",
        "params": sum(math.prod(shape) for shape in shapes),
        "peers": args.peers,
        "topk_fraction": topk_fraction,
        "kinds": kinds,
        "seconds": round(time.monotonic() - started, 1),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
