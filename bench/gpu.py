"""Item 7, on a CUDA device: per-peer samples/s of two collaborating peers (fp16 autocast, the trainer's default on
CUDA) against plain Hugging Face AMP loops on the same GPU.

Both sides share one GPU two ways at once, as item 1 shares the CPU: two plain loops side by side before and after
two peers. target_batch_size is sized from the plain loops so that an epoch lasts about as long as the CPU default's
(``GPU_EPOCH_SECONDS``): at 1024 samples a GPU would finish an epoch in a fraction of matchmaking_time.
"""

from __future__ import annotations

from pathlib import Path

from bench.formulas import epoch_target_batch_size
from bench.training import PAIR, against_plain, collab_pair, plain_pair, plain_seconds

GPU_EPOCH_SECONDS = 9.0  # about an epoch of the CPU default on 2 cores, so both spend a like share averaging


def cuda_device_name() -> str | None:
    """The first CUDA device's name, or None where there is none (then item 7 is reported as not measured)."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def gpu_efficiency(seconds: float, log_dir: Path, progress, device: str = "cuda") -> dict:
    """Plain pair, collaborating pair, plain pair, all on the first GPU; per-peer and per-loop samples/s.

    ``device="cpu"`` runs the same sequence on CPU (plain loops under CPU fp16 autocast, peers in fp32), only to
    check the sequence itself where there is no GPU.
    """
    name = cuda_device_name() if device == "cuda" else device
    if name is None:
        raise RuntimeError("item 7 needs a CUDA device: torch.cuda.is_available() is False")
    plain_flags = ["--device", device, "--fp16"]
    before = plain_pair(plain_seconds(seconds), log_dir, "gpu_0", plain_flags)
    progress("GPU plain loops")
    target = epoch_target_batch_size(before["samples_per_second"], GPU_EPOCH_SECONDS)
    run = collab_pair("gpu", ["--target_batch_size", target], log_dir, seconds=seconds)
    progress(f"GPU collaboration at target_batch_size {target}")
    after = plain_pair(plain_seconds(seconds), log_dir, "gpu_1", plain_flags)
    progress("GPU plain loops")
    run = against_plain(run, before, after)
    collab = run["samples_per_second"]
    return {
        "device": name,
        "target_batch_size": target,
        "per_peer_samples_per_second": collab and collab / PAIR,
        "plain_per_loop": [total / PAIR for total in run["plain_around"]],
        "efficiency": run["efficiency"],
        "averaging_rounds": run["averaging_rounds"],
        "window_s": run["window_s"],
    }
