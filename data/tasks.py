"""Small fine-tuning datasets in BoolQ's and SQuAD's formats, built offline from Python's own docstrings.

    python -m data.tasks --output_dir data/tasks      # boolq/{train,validation}.jsonl, squad/{train,validation}.jsonl

They exist to try and test ``--task seq-cls`` and ``--task qa`` without a download; the labels are synthetic but
learnable by design, so a tiny model's metric rises within a few global steps:

- BoolQ-style ``{question, passage, label}``: the question is always "is the passage python code?"; the passage is
  the start of a stdlib function's code (label 1) or of a docstring (label 0). Labels alternate, so the classes are
  balanced and an untrained model's accuracy is about 0.5; the two kinds of passage share few tokens, so even a
  tiny model separates them after a few global steps (a cue that hinges on one word, like "does it mention
  return?", took a tiny model far longer).
- SQuAD-style ``{id, question, context, answers: {text, answer_start}}``: the context is the start of a docstring,
  the answer is one of its words (letters only, at least 4 of them, occurring once in the context) and the
  question names that word ("where is the word pickle?"), so the answer span is the context token that also
  appears in the question.

Rows are a pure function of the docstrings (sorted files, fixed order): the same Python gives the same files.
"""

from __future__ import annotations

import ast
import hashlib
import itertools
import json
import re
import sys
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from collab.errors import ConfigError
from data.prepare import iter_stdlib_docstrings

BOOLQ_QUESTION = "is the passage python code?"
CLASSIFICATION_WORDS = 16
ANSWER_WORD = re.compile(r"\b[A-Za-z]{4,}\b")
PASSAGE_WORDS = 40


def passages(texts: Iterable[str], max_words: int = PASSAGE_WORDS) -> Iterator[str]:
    """The first ``max_words`` words of each text."""
    for text in texts:
        yield " ".join(text.split()[:max_words])


def code_snippets(root: str | Path, max_words: int = CLASSIFICATION_WORDS) -> Iterator[str]:
    """The first ``max_words`` words of each function body (docstring left out) of the modules directly in ``root``."""
    for path in sorted(Path(root).glob("*.py")):
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError, UnicodeDecodeError, RecursionError, MemoryError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body[1:] if ast.get_docstring(node) is not None else node.body
                words = ast.unparse(body).split()[:max_words] if body else []
                if len(words) >= 4:
                    yield " ".join(words)


def boolq_rows(code: Iterable[str], prose: Iterable[str], count: int) -> list[dict]:
    """``count`` rows {question, passage, label}: code (label 1) and prose (label 0) in turn."""
    sources = (iter(code), passages(prose, CLASSIFICATION_WORDS))
    rows = []
    for index in range(count):
        passage = next(sources[index % 2], None)
        if passage is None:
            break
        rows.append({"question": BOOLQ_QUESTION, "passage": passage, "label": int(index % 2 == 0)})
    return rows


def answer_word(context: str) -> re.Match | None:
    """A word of ``context`` that occurs once (letters only, 4 or more), picked by a hash of the context."""
    matches = list(ANSWER_WORD.finditer(context))
    counts: dict[str, int] = {}
    for match in matches:
        counts[match.group().lower()] = counts.get(match.group().lower(), 0) + 1
    unique = [m for m in matches if counts[m.group().lower()] == 1]
    if not unique:
        return None
    return unique[int(hashlib.sha256(context.encode()).hexdigest(), 16) % len(unique)]


def squad_rows(texts: Iterable[str], count: int, id_prefix: str = "q") -> list[dict]:
    """``count`` SQuAD-style rows whose answer is a context word the question names (see the module docstring)."""
    rows = []
    for context in passages(texts):
        match = answer_word(context)
        if match is None:
            continue
        rows.append(
            {
                "id": f"{id_prefix}{len(rows)}",
                "question": f"where is the word {match.group().lower()}?",
                "context": context,
                "answers": {"text": [match.group()], "answer_start": [match.start()]},
            }
        )
        if len(rows) == count:
            break
    return rows


def write_jsonl(rows: Sequence[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return path


def build(output_dir: str | Path, train: int = 2000, validation: int = 200) -> dict[str, Path]:
    """Write boolq/ and squad/ train.jsonl and validation.jsonl under ``output_dir``; returns their paths.

    Validation rows come from code and docstrings the training rows never use (the later part of the corpus).
    """
    root = sysconfig.get_paths()["stdlib"]
    texts = list(itertools.islice(iter_stdlib_docstrings(root), 4 * (train + validation)))
    code = list(itertools.islice(code_snippets(root), train + validation))
    text_cut, code_cut = len(texts) * train // (train + validation), len(code) * train // (train + validation)
    out = Path(output_dir)
    return {
        "boolq/train": write_jsonl(
            boolq_rows(code[:code_cut], texts[:text_cut], train), out / "boolq" / "train.jsonl"
        ),
        "boolq/validation": write_jsonl(
            boolq_rows(code[code_cut:], texts[text_cut:], validation), out / "boolq" / "validation.jsonl"
        ),
        "squad/train": write_jsonl(squad_rows(texts[:text_cut], train), out / "squad" / "train.jsonl"),
        "squad/validation": write_jsonl(
            squad_rows(texts[text_cut:], validation, "v"), out / "squad" / "validation.jsonl"
        ),
    }


@dataclass
class TaskDataArguments:
    """``python -m data.tasks``'s settings (parsed by arguments.parse_args, as the programs' are)."""

    output_dir: str = field(default="data/tasks", metadata={"help": "Folder for boolq/ and squad/"})
    train_examples: int = field(default=2000, metadata={"help": "Training rows per dataset"})
    validation_examples: int = field(default=200, metadata={"help": "Validation rows per dataset"})

    def __post_init__(self) -> None:
        for name in ("train_examples", "validation_examples"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name}: must be at least 1 (got {getattr(self, name)})")


def main(argv: Sequence[str] | None = None) -> int:
    from arguments import parse_args

    try:
        (args,) = parse_args([TaskDataArguments], argv, prog="python -m data.tasks")
    except ConfigError as e:
        print(f"python -m data.tasks: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)
    for name, path in build(args.output_dir, args.train_examples, args.validation_examples).items():
        print(f"{name}: {sum(1 for _ in open(path))} rows in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
