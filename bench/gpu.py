"""Item 7, on a CUDA device: per-peer samples/s of two collaborating peers (fp16 autocast, the trainer's default on
CUDA) against plain Hugging Face AMP loops on the same GPU.

Both sides share one GPU two ways at once, as item 1 shares the CPU: two plain loops side by side before and after
two peers. target_batch_size is sized from the plain loops so that an epoch lasts about as long as the CPU default's
(``GPU_EPOCH_SECONDS``): at 1024 samples a GPU would finish an epoch in a fraction of matchmaking_time.

Then ``GPU_MODES``: the same two peers in each precision and mode, on the default model and on a BERT-base shape
(about 90M parameters, from scratch), side by side in one run: per-peer samples/s, for the README's choice of mode.
Last ``gpu_loss``: the held-out loss of both modes' BERT-base peers after the same global batches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from bench.formulas import epoch_target_batch_size, mean, ratio
from bench.training import PAIR, against_plain, collab_pair, held_out_loss, plain_pair, plain_seconds
from bench.wan import lowcomm_flags

GPU_EPOCH_SECONDS = 9.0  # about an epoch of the CPU default on 2 cores, so both spend a like share averaging
BERT_BASE_SHAPE = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072}
BASE_TARGET_BATCH_SIZE = 2048
BASE_MICRO_BATCH = 32
# the README's rate for BERT-size models: at the default model's 0.2 both BERT-base peers of the low-communication mode
# diverged after three outer rounds (docs/benchmarks/2026-11-27-nvidia-h100-gpu.md)
BASE_LEARNING_RATE = 0.00176
MODES_LOCAL_STEPS = 4
# an outer round comes about every 10 s on one H100 (same file): a window of 100 s prices about ten of them
LOWCOMM_WINDOW_S = 100.0
# outer rounds of the loss comparison: 8 x 4 global batches of 2048, about 2.5 minutes a mode on one H100
GPU_LOSS_ROUNDS = 8


@dataclass(frozen=True)
class GpuMode:
    """One row of the modes table: ``model`` is "tiny" (the default model at item 7's target; item 7 is its fp16 sync
    row) or "base" (the BERT-base shape, where the modes compare); ``rounds`` the rounds its row counts (a key of
    ``collab_pair``'s result: gradient rounds, or the low-communication mode's outer rounds)."""

    setting: str
    model: str
    flags: tuple[str, ...]
    rounds: str = "averaging_rounds"
    min_window_s: float = 0.0


def base_lowcomm_mode(compression: str) -> GpuMode:
    """The BERT-base row of the low-communication mode with ``compression``'s pseudo-gradients."""
    return GpuMode(
        f"base bf16 lowcomm H={MODES_LOCAL_STEPS} {compression}",
        "base",
        ("--bf16", *lowcomm_flags(MODES_LOCAL_STEPS, compression)),
        rounds="outer_rounds",
        min_window_s=LOWCOMM_WINDOW_S,
    )


GPU_MODES = [
    GpuMode("tiny bf16 sync", "tiny", ("--bf16",)),
    GpuMode("base bf16 sync", "base", ("--bf16",)),
    base_lowcomm_mode("8bit"),
    base_lowcomm_mode("topk"),
]


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
    modes = gpu_modes(seconds, log_dir, progress, target)
    return {
        "modes": modes,
        "loss": gpu_loss(log_dir, progress),
        "device": name,
        "target_batch_size": target,
        "per_peer_samples_per_second": collab and collab / PAIR,
        "plain_per_loop": [total / PAIR for total in run["plain_around"]],
        "efficiency": run["efficiency"],
        "averaging_rounds": run["averaging_rounds"],
        "window_s": run["window_s"],
    }


def base_model_folder(log_dir: Path) -> Path:
    """A folder holding only a BERT-base-shaped config for the sample tokenizer: the trainer builds it from scratch."""
    from arguments import DatasetArguments
    from trainer.model import load_tokenizer, tiny_bert_config

    folder = log_dir / "bert_base_config"
    tokenizer = load_tokenizer(DatasetArguments())
    tiny_bert_config(len(tokenizer), pad_token_id=tokenizer.pad_token_id or 0, **BERT_BASE_SHAPE).save_pretrained(
        folder
    )
    return folder


def base_model_flags(log_dir: Path) -> list:
    """The trainer flags of a BERT-base peer (``base_model_folder``) at the README's batch and learning rate."""
    return [
        *("--model_name_or_path", base_model_folder(log_dir), "--target_batch_size", BASE_TARGET_BATCH_SIZE),
        *("--per_device_train_batch_size", BASE_MICRO_BATCH, "--learning_rate", BASE_LEARNING_RATE),
    ]


def gpu_modes(seconds: float, log_dir: Path, progress, tiny_target: int) -> list[dict]:
    """Per-peer samples/s of two peers on the GPU in each of ``GPU_MODES``; each row also lands in
    ``log_dir/gpu_modes.jsonl`` as it is measured, and a setting that fails is a row with its error."""
    base = base_model_flags(log_dir)
    sink = log_dir / "gpu_modes.jsonl"
    rows = []
    for mode in GPU_MODES:
        model_flags = ["--target_batch_size", tiny_target] if mode.model == "tiny" else base
        name = "gpu_" + mode.setting.replace(" ", "_").replace("=", "")
        try:
            window = max(seconds, mode.min_window_s)
            run = collab_pair(name, [*model_flags, *mode.flags], log_dir, seconds=window)
            collab = run["samples_per_second"]
            row = {
                "setting": mode.setting,
                "per_peer_samples_per_second": collab and collab / PAIR,
                "averaging_rounds": run[mode.rounds],
                "rounds": mode.rounds,
                "dropped_batches": run["dropped_batches"],
                "window_s": run["window_s"],
            }
        except Exception as e:  # one failed setting still leaves the others' figures
            row = {"setting": mode.setting, "error": f"{type(e).__name__}: {e}"[:500]}
        rows.append(row)
        with sink.open("a") as out:
            out.write(json.dumps(row) + "\n")
        progress(f"GPU {mode.setting}")
    return rows


def gpu_loss(log_dir: Path, progress, rounds: int = GPU_LOSS_ROUNDS, device: str = "cuda") -> dict:
    """The held-out loss (``held_out_loss`` on ``device``) of two BERT-base peers (bf16) after the same global batches
    in each mode: ``rounds`` outer rounds of ``MODES_LOCAL_STEPS`` in the low-communication mode, as many global
    batches in the synchronous one (bench.wan's rule, on loopback); ``ratio`` is low-communication over synchronous."""
    common = [*base_model_flags(log_dir), "--bf16"]
    runs = {}
    for mode, flags, epochs in (
        ("sync", [], rounds * MODES_LOCAL_STEPS),
        ("lowcomm", lowcomm_flags(MODES_LOCAL_STEPS, "8bit"), rounds),
    ):
        try:
            run = collab_pair(f"gpu_loss_{mode}", [*common, *flags], log_dir, max_steps=epochs, timeout=900)
            runs[mode] = {"held_out_loss": [held_out_loss(Path(folder), device) for folder in run["models"]]}
        except Exception as e:  # the other mode's figure still counts
            runs[mode] = {"error": f"{type(e).__name__}: {e}"[:500]}
        progress(f"GPU loss, {mode}")
    return {
        **runs,
        "global_batches": rounds * MODES_LOCAL_STEPS,
        "target_batch_size": BASE_TARGET_BATCH_SIZE,
        "local_steps": MODES_LOCAL_STEPS,
        "ratio": ratio(mean(runs["lowcomm"].get("held_out_loss")), mean(runs["sync"].get("held_out_loss"))),
    }
