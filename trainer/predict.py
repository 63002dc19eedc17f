"""Try a fine-tuned checkpoint on your own input, as the SQuAD seed's test script does.

    python -m trainer.predict --checkpoint checkpoints/40 --task qa --question "what is read?" --context "..."
    python -m trainer.predict --checkpoint checkpoints/40 --task seq-cls --text "return x + 1"
    python -m trainer.predict --checkpoint checkpoints/40 --task seq-cls --question "is it code?" --passage "..."

qa prints the answer span (the best over every window of a long context); seq-cls prints the label and its
probability. Bad input prints one line naming the flag and exits 2.

``--checkpoint`` is a monitor checkpoint (a folder or the web app's ``checkpoint-<step>.tar.gz``), verified against
its manifest, or a plain ``save_pretrained`` folder such as a trainer's ``--output_dir``. Either way the weights are
read from ``model.safetensors`` only and a folder holding links or odd names is refused: nothing in it runs code.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from datasets import Dataset

from arguments import QUESTION_ANSWERING, SEQUENCE_CLASSIFICATION, DatasetArguments, parse_args
from collab.checkpoint import MANIFEST, folder_files, is_archive, load_model, opened_checkpoint
from collab.errors import CheckpointError, ConfigError, InputError
from trainer.data import one_pass
from trainer.qa import predict_answers
from trainer.tasks import TASKS

PROG = "python -m trainer.predict"


@dataclass(frozen=True)
class PredictArguments:
    checkpoint: str = field(
        metadata={
            "help": "Saved model and tokenizer: a monitor checkpoint or --output_dir folder, or "
            "checkpoint-<step>.tar.gz"
        }
    )
    task: Literal[SEQUENCE_CLASSIFICATION, QUESTION_ANSWERING] = field(
        metadata={"help": "What the model was trained for"}
    )
    question: str | None = field(
        default=None, metadata={"help": "qa: the question; seq-cls: the first text of a pair (BoolQ)"}
    )
    context: str | None = field(default=None, metadata={"help": "qa: the text that holds the answer"})
    passage: str | None = field(default=None, metadata={"help": "seq-cls: the second text of a pair (BoolQ)"})
    text: str | None = field(default=None, metadata={"help": "seq-cls: a single text to classify"})
    max_seq_length: int = field(default=384, metadata={"help": "Window length (tokens)"})
    doc_stride: int = field(default=128, metadata={"help": "Window overlap (tokens)"})


def parse(argv: Sequence[str] | None) -> PredictArguments:
    """The flags through the programs' shared parser (one line naming the flag), then the checks between them."""
    try:
        (args,) = parse_args([PredictArguments], argv, prog=PROG)
    except ConfigError as e:
        raise InputError(str(e)) from None
    if not is_archive(args.checkpoint) and not (Path(args.checkpoint) / "config.json").is_file():
        raise InputError(f"--checkpoint: no saved model (config.json) in {args.checkpoint}")
    if args.task == QUESTION_ANSWERING:
        for flag in ("question", "context"):
            if not (getattr(args, flag) or "").strip():
                raise InputError(f"--{flag}: required (non-empty) for --task qa")
    elif not (args.text or (args.question and args.passage)):
        raise InputError("--text: required for --task seq-cls (or give --question and --passage)")
    if args.doc_stride >= args.max_seq_length // 2:
        raise InputError(f"--doc_stride: must be under half of --max_seq_length ({args.max_seq_length})")
    return args


@contextlib.contextmanager
def model_folder(path: str) -> Iterator[Path]:
    """The folder to load: a checkpoint verified against its manifest, or a plain folder checked for links and odd
    names (it has no manifest to verify)."""
    if is_archive(path) or (Path(path) / MANIFEST).exists():
        with opened_checkpoint(path) as (folder, _):
            yield folder
    else:
        folder_files(path)
        yield Path(path)


def answer(model, tokenizer, question: str, context: str, max_seq_length: int, doc_stride: int) -> str:
    """The best answer span of ``context`` for ``question``."""
    rows = Dataset.from_list(
        [{"id": "0", "question": question, "context": context, "answers": {"text": [], "answer_start": []}}]
    )
    settings = DatasetArguments(task=QUESTION_ANSWERING, max_seq_length=max_seq_length, doc_stride=doc_stride)
    task = TASKS[QUESTION_ANSWERING]
    features = task.prepare(rows, tokenizer, settings)
    starts, ends = [], []
    with torch.no_grad():
        for batch in one_pass(features, task.collator(tokenizer), 8, QUESTION_ANSWERING):
            output = model(**{k: v for k, v in batch.items() if k not in ("start_positions", "end_positions")})
            starts += list(output.start_logits.numpy())
            ends += list(output.end_logits.numpy())
    return predict_answers(features, starts, ends)["0"][0]


def classify(model, tokenizer, texts: Sequence[str]) -> tuple[str, float]:
    """(label name, probability) of the most likely class."""
    with torch.no_grad():
        logits = model(**tokenizer(*texts, truncation=True, return_tensors="pt")).logits[0]
    probabilities = logits.softmax(-1)
    best = int(probabilities.argmax())
    return model.config.id2label.get(best, str(best)), float(probabilities[best])


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse(argv)
    except InputError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    try:
        with model_folder(args.checkpoint) as folder:
            tokenizer = AutoTokenizer.from_pretrained(folder)
            model = load_model(folder, TASKS[args.task].model_class).eval()
    except CheckpointError as e:
        print(f"{PROG}: error: --checkpoint: {e}", file=sys.stderr)
        return 2
    if args.task == QUESTION_ANSWERING:
        print(answer(model, tokenizer, args.question, args.context, args.max_seq_length, args.doc_stride))
    else:
        label, probability = classify(model, tokenizer, [args.text] if args.text else [args.question, args.passage])
        print(f"{label}\t{probability:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
