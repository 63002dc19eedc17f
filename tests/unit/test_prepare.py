"""Tests for data.prepare on tiny real corpora (stdlib docstrings, temp text files); no network, no mocks."""

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from data.prepare import build, iter_stdlib_docstrings, main, split_train_validation

pytestmark = pytest.mark.light

REPO = Path(__file__).resolve().parents[2]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
VOCAB, SEQ, FRACTION = 200, 32, 0.1
SMALL = ["--vocab_size", str(VOCAB), "--max_seq_length", str(SEQ), "--validation_fraction", str(FRACTION)]


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory) -> Path:
    """~60 real docstrings (json and concurrent packages), one per line."""
    docs = [d for pkg in ("json", "concurrent") for d in iter_stdlib_docstrings(STDLIB / pkg)]
    assert len(docs) > 30
    path = tmp_path_factory.mktemp("corpus") / "docs.txt"
    path.write_text("\n".join(docs) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def built(corpus_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("built") / "sample"
    assert main(["--text_files", str(corpus_file), "--output_dir", str(out), *SMALL]) == 0
    return out


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp" in p.name)


def test_iter_stdlib_docstrings_parses_without_importing(tmp_path):
    sentinel = tmp_path / "imported.flag"
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "mod.py").write_text(
        f'"""Module docstring that is long enough to be kept by the reader."""\n'
        f"open({str(sentinel)!r}, 'w').write('x')\n"
        "raise SystemExit('this module must never be imported')\n"
        "class Thing:\n"
        '    """Class docstring, also comfortably above forty characters.\n\n    Second paragraph."""\n'
        "    def method(self):\n"
        '        """Too short."""\n'
        "def func():\n"
        '    """Module docstring that is long enough to be kept by the reader."""\n'
    )
    (pkg / "broken.py").write_text('"""A docstring in a file that does not parse at all, so skipped."""\ndef (:\n')
    (pkg / "latin.py").write_bytes(b'"""Caf\xe9 docstring in a file that is not valid UTF-8 and has no cookie."""\n')
    for skipped in ("tests", "site-packages", "idlelib"):
        (tmp_path / skipped).mkdir()
        (tmp_path / skipped / "x.py").write_text('"""A docstring inside a folder that must be skipped entirely."""\n')

    docs = list(iter_stdlib_docstrings(tmp_path))

    assert docs == [
        "Module docstring that is long enough to be kept by the reader.",
        "Class docstring, also comfortably above forty characters. Second paragraph.",
    ]
    assert not sentinel.exists()


def test_split_is_stable_disjoint_and_never_empty():
    docs = [f"document number {i} about nothing in particular" for i in range(2000)]
    train, val = split_train_validation(docs, 0.02)
    assert (train, val) == split_train_validation(list(docs), 0.02)
    assert sorted(train + val) == sorted(docs) and not set(train) & set(val)
    assert 10 < len(val) < 80  # ~2% of 2000
    # membership depends on the text only, not on position or the other documents
    assert split_train_validation(list(reversed(docs)), 0.02)[1] == list(reversed(val))
    tiny_train, tiny_val = split_train_validation(docs[:2], 0.01)
    assert len(tiny_train) == len(tiny_val) == 1


def test_build_layout_and_blocks(built, corpus_file):
    from datasets import load_from_disk

    assert sorted(p.name for p in built.iterdir()) == ["prepare_info.json", "tokenized", "tokenizer", "validation.txt"]
    assert _leftovers(built.parent) == []
    info = json.loads((built / "prepare_info.json").read_text())
    dsd = load_from_disk(str(built / "tokenized"))
    assert set(dsd) == {"train", "validation"}
    assert info["blocks"] == {"train": len(dsd["train"]), "validation": len(dsd["validation"])}
    assert len(dsd["train"]) > len(dsd["validation"]) > 0
    assert info["max_seq_length"] == SEQ and len(info["train_text_sha256"]) == 64

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built / "tokenizer")
    assert info["vocab_size"] == len(tok) <= VOCAB
    for split in dsd.values():
        assert split.column_names == ["input_ids", "attention_mask", "special_tokens_mask"]
        for row in split:
            ids = row["input_ids"]
            assert len(ids) == len(row["attention_mask"]) == len(row["special_tokens_mask"]) == SEQ
            assert ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id and tok.pad_token_id not in ids
            assert row["special_tokens_mask"] == [int(t in (tok.cls_token_id, tok.sep_token_id)) for t in ids]
            assert all(row["attention_mask"])

    val_lines = (built / "validation.txt").read_text(encoding="utf-8").splitlines()
    corpus_lines = set(corpus_file.read_text(encoding="utf-8").splitlines())
    assert len(val_lines) == info["documents"]["validation"] > 0
    assert set(val_lines) <= corpus_lines


def test_tokenizer_round_trip(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built / "tokenizer")
    assert tok.mask_token == "[MASK]" and tok.pad_token == "[PAD]" and tok.model_max_length == SEQ
    text = "Serialize obj as a JSON formatted stream to fp"
    decoded = tok.decode(tok.encode(text), skip_special_tokens=True)
    assert decoded.split() == text.lower().split()
    assert tok.unk_token_id not in tok.encode(text)


def test_rerun_is_up_to_date_and_rebuild_is_identical(built, corpus_file, tmp_path, capsys):
    from datasets import load_from_disk

    arrow = built / "tokenized" / "train" / "data-00000-of-00001.arrow"
    before = arrow.stat().st_mtime_ns
    assert main(["--text_files", str(corpus_file), "--output_dir", str(built), *SMALL]) == 0
    assert "up to date" in capsys.readouterr().out
    assert arrow.stat().st_mtime_ns == before

    again = tmp_path / "again"
    info, rebuilt = build(
        again, text_files=[str(corpus_file)], vocab_size=VOCAB, max_seq_length=SEQ, validation_fraction=FRACTION
    )
    assert rebuilt
    assert info["train_text_sha256"] == json.loads((built / "prepare_info.json").read_text())["train_text_sha256"]
    assert (again / "tokenizer" / "tokenizer.json").read_bytes() == (
        built / "tokenizer" / "tokenizer.json"
    ).read_bytes()
    first, second = load_from_disk(str(built / "tokenized")), load_from_disk(str(again / "tokenized"))
    for split in ("train", "validation"):
        assert first[split]["input_ids"] == second[split]["input_ids"]

    # changed options -> rebuilt in place, old content replaced
    info, rebuilt = build(again, text_files=[str(corpus_file)], vocab_size=VOCAB, max_seq_length=16)
    assert rebuilt and info["max_seq_length"] == 16
    assert len(load_from_disk(str(again / "tokenized"))["train"][0]["input_ids"]) == 16
    assert _leftovers(tmp_path) == []


def test_existing_tokenizer_without_special_tokens(corpus_file, tmp_path):
    """A GPT-2-like tokenizer (byte-level BPE, no pad/cls/sep): plain run_mlm-style cut, nothing forced."""
    from datasets import load_from_disk
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer, raw.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    raw.train([str(corpus_file)], trainers.BpeTrainer(vocab_size=300, show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=raw).save_pretrained(tmp_path / "bpe")

    out = tmp_path / "out"
    argv = ["--text_files", str(corpus_file), "--tokenizer_path", str(tmp_path / "bpe"), "--output_dir", str(out)]
    assert main([*argv, "--max_seq_length", str(SEQ), "--validation_fraction", str(FRACTION)]) == 0
    dsd = load_from_disk(str(out / "tokenized"))
    assert len(dsd["train"]) > 0 and len(dsd["validation"]) > 0
    assert all(len(ids) == SEQ for ids in dsd["train"]["input_ids"])
    assert not any(any(mask) for mask in dsd["train"]["special_tokens_mask"])
    assert json.loads((out / "prepare_info.json").read_text())["tokenizer"] == str(tmp_path / "bpe")


@pytest.mark.parametrize(
    "args, option",
    [
        (["--text_files", "missing.txt"], "--text_files"),
        (["--text_files", "EMPTY"], "--text_files"),
        (["--text_files", "CORPUS", "--max_seq_length", "4"], "--max_seq_length"),
        (["--text_files", "CORPUS", "--vocab_size", "50"], "--vocab_size"),
        (["--text_files", "CORPUS", "--validation_fraction", "0.5"], "--validation_fraction"),
        (["--text_files", "CORPUS", "--validation_fraction", "0"], "--validation_fraction"),
        (["--text_files", "CORPUS", "--max_seq_length", "many"], "--max_seq_length"),  # argparse type error
    ],
)
def test_bad_options_fail_with_one_line_and_write_nothing(args, option, corpus_file, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("\n   \n\n")
    subst = {"EMPTY": str(tmp_path / "empty.txt"), "CORPUS": str(corpus_file)}
    out = tmp_path / "parent" / "out"
    rc = main(
        [subst.get(a, a) for a in args]
        + ["--output_dir", str(out)]
        + ["--vocab_size", "200"] * (option != "--vocab_size")
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.count("\n") == 0 and err.startswith("error:") and option in err, err
    assert not (tmp_path / "parent").exists()


def test_corpus_too_small_for_one_block_writes_nothing(corpus_file, tmp_path, capsys):
    """Found only after tokenizing (progress bars may precede it): still a one-line error, nothing written."""
    out = tmp_path / "parent" / "out"
    argv = [
        "--text_files",
        str(corpus_file),
        "--output_dir",
        str(out),
        "--vocab_size",
        "200",
        "--max_seq_length",
        "2048",
    ]
    assert main(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: --max_seq_length: the validation split is shorter than one block")
    assert not (tmp_path / "parent").exists()


def test_foreign_output_dir_is_left_alone(corpus_file, tmp_path, capsys):
    (tmp_path / "mine.txt").write_text("precious")
    assert main(["--text_files", str(corpus_file), "--output_dir", str(tmp_path), *SMALL]) == 2
    assert "--output_dir" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["mine.txt"]


def test_cli_error_has_no_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "data.prepare", "--text_files", "nope.txt", "--output_dir", str(tmp_path / "o")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: --text_files: no such file 'nope.txt'; check the path"
    assert not (tmp_path / "o").exists()
