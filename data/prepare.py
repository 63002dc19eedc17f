"""Build the tokenizer and tokenized dataset the training client reads, offline and deterministically.

Default (no arguments): docstrings of Python's own standard library (read with ``ast``, never imported) ->
``data/sample``. Options accept your own text files, a Hub dataset (needs network) or an existing tokenizer.

    python -m data.prepare                              # sample corpus, up-to-date check makes reruns instant
    python -m data.prepare --text_files a.txt b.txt     # one document per non-empty line
    python -m data.prepare --dataset_name wikitext --dataset_config wikitext-103-raw-v1 --output_dir data/wt103
    python -m data.prepare --tokenizer_path gpt2 ...    # reuse a tokenizer (no [CLS]/[SEP] wrapping)

Output: <output_dir>/tokenizer (save_pretrained), <output_dir>/tokenized (DatasetDict: train, validation;
columns input_ids, attention_mask, special_tokens_mask), validation.txt, prepare_info.json.
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import os
import platform
import sys
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from collab.errors import ConfigError, PrepareError
from collab.storage import atomic_directory

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
SPECIAL_TOKEN_KWARGS = {
    "pad_token": "[PAD]",
    "unk_token": "[UNK]",
    "cls_token": "[CLS]",
    "sep_token": "[SEP]",
    "mask_token": "[MASK]",
}
SPECIAL_TOKENS = list(SPECIAL_TOKEN_KWARGS.values())
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
MIN_DOC_CHARS = 40
STDLIB_MAX_DOCUMENTS = 20000  # ~6.3k docs / 1.6 MB on CPython 3.11; the cap bounds build time on bigger stdlibs


def normalize(text: str) -> str:
    """One document -> one line: every whitespace run (newlines, blank lines, indentation) becomes one space."""
    return " ".join(text.split())


def iter_stdlib_docstrings(root: str | os.PathLike, min_chars: int = MIN_DOC_CHARS) -> Iterator[str]:
    """Yield module/class/function docstrings of the .py files under ``root`` (sorted paths), parsed, never imported.

    Skips SKIP_DIRS and files that fail to decode or parse; drops docstrings shorter than ``min_chars`` after
    whitespace normalisation and exact duplicates (the first occurrence wins).
    """
    from tqdm.auto import tqdm

    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        files.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    seen: set[str] = set()
    for path in tqdm(sorted(files), desc="reading docstrings", unit="file", disable=None):
        try:
            tree = ast.parse(Path(path).read_bytes(), filename=path)
        except (SyntaxError, ValueError, UnicodeDecodeError, RecursionError, MemoryError, OSError):
            logger.debug("skipping unparsable %s", path)
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = normalize(ast.get_docstring(node) or "")
                if len(doc) >= min_chars and doc not in seen:
                    seen.add(doc)
                    yield doc


def read_text_files(paths: Sequence[str]) -> list[str]:
    """One document per non-empty line (whitespace-normalised), files in the order given."""
    docs = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                docs.extend(doc for doc in map(normalize, f) if doc)
        except UnicodeDecodeError:
            raise PrepareError("--text_files", f"'{path}' is not UTF-8 text; convert it to UTF-8") from None
    return docs


def load_hub_texts(name: str, config: str | None, column: str) -> list[str]:
    """Texts of the ``train`` split (else the first split) of a datasets.load_dataset dataset; needs network."""
    import datasets

    try:
        dsd = datasets.load_dataset(name, config)
    except Exception as e:  # network, unknown name/config, ...: all mean "this option is wrong here"
        raise PrepareError("--dataset_name", f"cannot load '{name}': {str(e).splitlines()[0]}") from None
    split = "train" if "train" in dsd else sorted(dsd)[0]
    if column not in dsd[split].column_names:
        raise PrepareError("--text_column", f"'{column}' not in {dsd[split].column_names}; pass one of them")
    return [doc for doc in map(normalize, dsd[split][column]) if doc]


def load_corpus(text_files, dataset_name, dataset_config, text_column) -> tuple[list[str], str]:
    """Documents of the chosen source (text files, Hub dataset, else stdlib docstrings) and a one-line description."""
    if text_files:
        docs, source, option = read_text_files(text_files), f"text files {' '.join(text_files)}", "--text_files"
    elif dataset_name:
        docs, option = load_hub_texts(dataset_name, dataset_config, text_column), "--dataset_name"
        source = f"hub dataset {dataset_name}" + (f" ({dataset_config})" if dataset_config else "")
    else:
        root = sysconfig.get_paths()["stdlib"]
        docs, source = list(iter_stdlib_docstrings(root)), f"python {platform.python_version()} stdlib docstrings"
        option = "--text_files"  # the fix for a stdlib without docstrings is to bring your own text
    if not docs:
        raise PrepareError(option, f"the corpus ({source}) has no text; give non-empty documents")
    return docs, source


def _hash_unit(text: str) -> float:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2**64


def split_train_validation(docs: Sequence[str], fraction: float) -> tuple[list[str], list[str]]:
    """Stable split: a document goes to validation iff sha256(text) maps below ``fraction`` (order is kept).

    Identical texts always land in the same split. With very few documents, the lowest (highest) hash is moved
    so that neither split is empty.
    """
    if len(docs) < 2:
        raise PrepareError("--validation_fraction", f"need at least 2 documents to split, got {len(docs)}; add text")
    units = [_hash_unit(d) for d in docs]
    is_val = [u < fraction for u in units]
    if not any(is_val):
        is_val[min(range(len(docs)), key=units.__getitem__)] = True
    if all(is_val):
        is_val[max(range(len(docs)), key=units.__getitem__)] = False
    train = [d for d, v in zip(docs, is_val, strict=True) if not v]
    return train, [d for d, v in zip(docs, is_val, strict=True) if v]


def train_tokenizer(texts: Iterable[str], vocab_size: int, max_len: int) -> PreTrainedTokenizerFast:
    """Train a lowercase BERT-style WordPiece tokenizer ([PAD] [UNK] [CLS] [SEP] [MASK]) on ``texts``.

    The tokenizers trainer numbers the ``##x`` continuation pieces in hash-map order, which changes merge tie-breaks
    between runs (huggingface/tokenizers#1794). Seeding them, sorted, as extra tokens makes training reproducible;
    they are then turned back into ordinary vocabulary entries.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizerFast

    texts = list(texts)
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    continuations = set()
    for text in texts:
        for word, _ in tok.pre_tokenizer.pre_tokenize_str(tok.normalizer.normalize_str(text)):
            continuations.update(word[1:])
    seeded = SPECIAL_TOKENS + ["##" + c for c in sorted(continuations)]
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=seeded, show_progress=False)
    tok.train_from_iterator(texts, trainer, length=len(texts))

    final = Tokenizer(models.WordPiece(tok.get_vocab(), unk_token="[UNK]", continuing_subword_prefix="##"))
    final.normalizer, final.pre_tokenizer, final.decoder = tok.normalizer, tok.pre_tokenizer, decoders.WordPiece()
    final.add_special_tokens(SPECIAL_TOKENS)
    cls_id, sep_id = final.token_to_id("[CLS]"), final.token_to_id("[SEP]")
    final.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return BertTokenizerFast(
        tokenizer_object=final, model_max_length=max_len, do_lower_case=True, **SPECIAL_TOKEN_KWARGS
    )


def tokenize_and_group(
    texts: list[str], tokenizer: PreTrainedTokenizerBase, max_seq_length: int, wrap: bool
) -> Dataset:
    """Tokenize ``texts`` and pack them into blocks of exactly ``max_seq_length`` tokens (run_mlm.py group_texts).

    wrap=True (our BERT tokenizer): stream = doc1 [SEP] doc2 [SEP] ..., cut into max_seq_length-2 pieces, each
    block = [CLS] piece [SEP]. wrap=False (a user tokenizer): the tokenizer's own special tokens, plain cut.
    The remainder of each 1000-document batch shorter than a block is dropped.
    """
    from datasets import Dataset

    special = set(tokenizer.all_special_ids)
    keys = ["input_ids", "attention_mask", "special_tokens_mask"]

    def tokenize(batch):
        enc = tokenizer(batch["text"], add_special_tokens=not wrap, return_special_tokens_mask=True, verbose=False)
        return {k: enc[k] for k in keys}

    def group(batch):
        if not wrap:
            cat = {k: [t for seq in batch[k] for t in seq] for k in keys}
            n = len(cat["input_ids"]) // max_seq_length * max_seq_length
            return {k: [v[i : i + max_seq_length] for i in range(0, n, max_seq_length)] for k, v in cat.items()}
        cls, sep, step = tokenizer.cls_token_id, tokenizer.sep_token_id, max_seq_length - 2
        stream = [t for seq in batch["input_ids"] for t in [*seq, sep]]
        ids = [[cls, *stream[i : i + step], sep] for i in range(0, len(stream) - step + 1, step)]
        return {
            "input_ids": ids,
            "attention_mask": [[1] * max_seq_length for _ in ids],
            "special_tokens_mask": [[int(t in special) for t in block] for block in ids],
        }

    ds = Dataset.from_dict({"text": texts})
    ds = ds.map(tokenize, batched=True, remove_columns=["text"], desc="tokenizing")
    return ds.map(group, batched=True, batch_size=1000, desc=f"grouping into blocks of {max_seq_length}")


def _source_options(text_files, dataset_name, dataset_config, text_column) -> dict:
    if text_files:
        stats = [(os.path.abspath(p), os.stat(p)) for p in text_files]
        return {"kind": "text_files", "files": [[p, st.st_size, st.st_mtime_ns] for p, st in stats]}
    if dataset_name:
        return {"kind": "hub", "name": dataset_name, "config": dataset_config, "column": text_column}
    return {"kind": "stdlib_docstrings", "python": platform.python_version(), "root": sysconfig.get_paths()["stdlib"]}


@dataclass
class PrepareArguments:
    """``python -m data.prepare``'s settings (parsed by arguments.parse_args, as the programs' are)."""

    output_dir: str = field(default="data/sample", metadata={"help": "Where to write"})
    text_files: list[str] | None = field(
        default=None, metadata={"help": "UTF-8 text files, one document per non-empty line"}
    )
    dataset_name: str | None = field(
        default=None, metadata={"help": "datasets.load_dataset name (needs network); uses its train split"}
    )
    dataset_config: str | None = field(
        default=None, metadata={"help": "Dataset config name, e.g. wikitext-103-raw-v1"}
    )
    text_column: str = field(default="text", metadata={"help": "Text column of --dataset_name"})
    tokenizer_path: str | None = field(
        default=None, metadata={"help": "Existing tokenizer folder or Hub name instead of training one"}
    )
    vocab_size: int = field(default=4096, metadata={"help": "Size of the trained tokenizer (tokens)"})
    max_seq_length: int = field(default=128, metadata={"help": "Tokens per block"})
    validation_fraction: float = field(default=0.02, metadata={"help": "Share of documents held out"})
    max_documents: int | None = field(
        default=None,
        metadata={
            "help": f"Keep the first N documents (unset: {STDLIB_MAX_DOCUMENTS} for the stdlib sample, all others)"
        },
    )
    force: bool = field(default=False, metadata={"help": "Rebuild even if the output is up to date"})


def check_options(output_dir, text_files, dataset_name, vocab_size, max_seq_length, fraction, max_documents) -> None:
    """Raise PrepareError for bad options before anything is read or written."""
    if max_seq_length < 8:
        raise PrepareError("--max_seq_length", f"must be >= 8, got {max_seq_length}")
    if vocab_size < 100:
        raise PrepareError("--vocab_size", f"must be >= 100, got {vocab_size}")
    if not 0 < fraction < 0.5:
        raise PrepareError("--validation_fraction", f"must be between 0 and 0.5 (exclusive), got {fraction}")
    if max_documents is not None and max_documents < 2:
        raise PrepareError("--max_documents", f"must be >= 2, got {max_documents}")
    if text_files and dataset_name:
        raise PrepareError("--text_files", "cannot be combined with --dataset_name; pick one source")
    for path in text_files or ():
        if not os.path.isfile(path):
            raise PrepareError("--text_files", f"no such file '{path}'; check the path")
    out = Path(output_dir)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "prepare_info.json").is_file())):
        raise PrepareError("--output_dir", f"'{out}' exists and was not made by data.prepare; pick another folder")


def is_up_to_date(output_dir: str | os.PathLike, options: dict) -> bool:
    """True when ``output_dir`` holds a complete build made with exactly ``options``."""
    out = Path(output_dir)
    try:
        info = json.loads((out / "prepare_info.json").read_text())
    except (OSError, ValueError):
        return False
    complete = (out / "tokenized" / "dataset_dict.json").is_file() and (out / "tokenizer").is_dir()
    return complete and info.get("options") == options


def build(
    output_dir=PrepareArguments.output_dir,
    *,
    text_files=None,
    dataset_name=None,
    dataset_config=None,
    text_column=PrepareArguments.text_column,
    tokenizer_path=None,
    vocab_size=PrepareArguments.vocab_size,
    max_seq_length=PrepareArguments.max_seq_length,
    validation_fraction=PrepareArguments.validation_fraction,
    max_documents=None,
    force=False,
) -> tuple[dict, bool]:
    """Build everything into a temporary sibling folder, then swap it into ``output_dir``.

    Returns (prepare_info, rebuilt); rebuilt is False when the existing output already matched the options.
    """
    check_options(output_dir, text_files, dataset_name, vocab_size, max_seq_length, validation_fraction, max_documents)
    options = {
        "format_version": FORMAT_VERSION,
        "code_sha256": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16],  # edits here -> rebuild
        "source": _source_options(text_files, dataset_name, dataset_config, text_column),
        "tokenizer_path": tokenizer_path,
        "vocab_size": None if tokenizer_path else vocab_size,
        "max_seq_length": max_seq_length,
        "validation_fraction": validation_fraction,
        "max_documents": max_documents,
    }
    out = Path(output_dir)
    if not force and is_up_to_date(out, options):
        logger.info("%s is up to date (same options); use --force to rebuild", out)
        return json.loads((out / "prepare_info.json").read_text()), False

    tokenizer = None
    if tokenizer_path:  # before reading the corpus, so a bad name fails fast
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        except (OSError, ValueError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise PrepareError(
                "--tokenizer_path", f"cannot load '{tokenizer_path}' ({msg}); pass a tokenizer folder"
            ) from None
    docs, source = load_corpus(text_files, dataset_name, dataset_config, text_column)
    if not (text_files or dataset_name):
        max_documents = max_documents or STDLIB_MAX_DOCUMENTS
    docs = docs[:max_documents]
    train, val = split_train_validation(docs, validation_fraction)
    mb = sum(map(len, docs)) / 1e6
    logger.info("%s: %d documents (%d train, %d validation), %.2f MB", source, len(docs), len(train), len(val), mb)
    if tokenizer is None:
        logger.info("training WordPiece tokenizer (vocab %d) on the train split", vocab_size)
        tokenizer = train_tokenizer(train, vocab_size, max_seq_length)
    from datasets import DatasetDict

    wrap, parts = tokenizer_path is None, {"train": train, "validation": val}
    splits = DatasetDict({k: tokenize_and_group(v, tokenizer, max_seq_length, wrap) for k, v in parts.items()})
    for name, ds in splits.items():
        if len(ds) == 0:
            hint = "add text, lower --max_seq_length or raise --validation_fraction"
            raise PrepareError("--max_seq_length", f"the {name} split is shorter than one block; {hint}")

    info = {
        "options": options,
        "source": source,
        "documents": {"train": len(train), "validation": len(val)},
        "characters": {"train": sum(map(len, train)), "validation": sum(map(len, val))},
        "blocks": {name: len(ds) for name, ds in splits.items()},
        "vocab_size": len(tokenizer),
        "max_seq_length": max_seq_length,
        "tokenizer": tokenizer_path or "trained WordPiece (lowercase, BERT-style)",
        "train_text_sha256": hashlib.sha256("\n".join(train).encode("utf-8")).hexdigest(),
    }
    with atomic_directory(out) as staging:
        tokenizer.save_pretrained(staging / "tokenizer")
        splits.save_to_disk(str(staging / "tokenized"))
        (staging / "validation.txt").write_text("".join(d + "\n" for d in val), encoding="utf-8")
        (staging / "prepare_info.json").write_text(json.dumps(info, indent=2) + "\n")  # last: marks completeness
    logger.info("wrote %s", out)
    return info, True


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 built or up to date, 2 bad input)."""
    from arguments import parse_args

    try:
        (args,) = parse_args([PrepareArguments], argv, prog="python -m data.prepare")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        info, rebuilt = build(**vars(args))
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    docs, blocks, seq = info["documents"], info["blocks"], info["max_seq_length"]
    split_text = ", ".join(f"{k} {docs[k]} docs -> {blocks[k]} blocks" for k in ("train", "validation"))
    state = "built" if rebuilt else "up to date"
    print(f"{args.output_dir}: {state}: {split_text} of {seq} tokens, vocab {info['vocab_size']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
