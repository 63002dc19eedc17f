"""``run_trainer.py`` as a lying groupmate: ``python tests/liar_peer.py [trainer flags]``.

Every tensor part this peer sends into an averaging round, gradients and parameters alike, arrives as fp16 inf: its
fp16 compression is replaced, in this process only, before the real ``run_trainer.main`` runs. Whole tensors (the
state it serves to a newcomer) stay honest, so only the averaging rounds are attacked.
"""

from __future__ import annotations

import sys

import torch
from hivemind.compression import CompressionInfo, Float16Compression
from hivemind.proto import runtime_pb2


class NonFiniteParts(Float16Compression):
    """fp16 compression that sends inf for every all-reduce part (a ``CompressionInfo`` with a ``part_size``)."""

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        serialized = super().compress(tensor, info, allow_inplace)
        if info.part_size is not None:
            serialized.buffer = torch.full(tuple(tensor.shape), float("inf"), dtype=torch.float16).numpy().tobytes()
        return serialized


def install() -> None:
    import collab.optim

    collab.optim.Float16Compression = NonFiniteParts  # build_optimizer's gradient and parameter compression


def main() -> int:
    install()
    import run_trainer

    return run_trainer.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
