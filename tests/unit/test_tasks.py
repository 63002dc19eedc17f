"""The task registry, preprocessing (QA windows), evaluation keys and starting from a local pretrained folder."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from datasets import Dataset

from arguments import DatasetArguments
from collab.errors import SetupError
from data.tasks import answer_word, boolq_rows, squad_rows
from trainer.model import build_model, load_tokenizer
from trainer.predict import main as predict_main
from trainer.qa import answer_token_span, best_span
from trainer.tasks import TASKS

pytestmark = pytest.mark.light

EVAL_KEYS = {"eval_loss", "eval_perplexity", "eval_accuracy", "eval_exact_match", "eval_f1"}
CONTEXT = " ".join(f"word{i}" for i in range(60)) + " the answer is pickle here " + " ".join(f"w{i}" for i in range(9))
ANSWER_START = CONTEXT.index("pickle")


@pytest.fixture(scope="module")
def tokenizer(sample_data):
    return load_tokenizer(DatasetArguments(tokenizer_path=str(sample_data / "tokenizer")))


def squad_rows_for_test() -> Dataset:
    return Dataset.from_list(
        [
            {
                "id": "long",
                "question": "where is pickle?",
                "context": CONTEXT,
                "answers": {"text": ["pickle"], "answer_start": [ANSWER_START]},
            },
        ]
    )


def test_registry_has_every_task_with_its_head():
    assert set(TASKS) == {"mlm", "clm", "seq-cls", "qa"}
    assert [TASKS[t].model_class.__name__ for t in ("mlm", "clm", "seq-cls", "qa")] == [
        "AutoModelForMaskedLM",
        "AutoModelForCausalLM",
        "AutoModelForSequenceClassification",
        "AutoModelForQuestionAnswering",
    ]


@pytest.mark.parametrize(
    "task, head",
    [
        ("mlm", "BertForMaskedLM"),
        ("clm", "BertLMHeadModel"),
        ("seq-cls", "BertForSequenceClassification"),
        ("qa", "BertForQuestionAnswering"),
    ],
)
def test_tiny_default_model_for_every_task(task, head, tokenizer):
    model, name = build_model(DatasetArguments(task=task), tokenizer, seed=0)
    assert (type(model).__name__, name) == (head, task)


def test_answer_token_span_by_hand():
    # tokens: [CLS] q [SEP] "the"(0,3) "cat"(4,7) "sat"(8,11) [SEP]
    offsets = [(0, 0), (0, 1), (0, 0), (0, 3), (4, 7), (8, 11), (0, 0)]
    sequence_ids = [None, 0, None, 1, 1, 1, None]
    assert answer_token_span(offsets, sequence_ids, 4, 11) == (4, 5)
    assert answer_token_span(offsets, sequence_ids, 5, 7) == (4, 4)  # inside a token: that token
    assert answer_token_span(offsets, sequence_ids[:5] + [None, None], 8, 11) == (0, 0)  # not in this window


def test_long_context_windows_overlap_and_map_the_answer(tokenizer):
    args = DatasetArguments(task="qa", max_seq_length=48, doc_stride=16)
    features = TASKS["qa"].prepare(squad_rows_for_test(), tokenizer, args)
    assert len(features) > 2 and set(features["example_id"]) == {"long"}
    holding = [f for f in features if f["start_positions"] != 0]
    assert holding, "no window holds the answer"
    for feature in holding:
        start, end = feature["start_positions"], feature["end_positions"]
        assert tokenizer.decode(feature["input_ids"][start : end + 1]) == "pickle"
        assert feature["offset_mapping"][start][0] == ANSWER_START
    for feature in features:
        if feature not in holding:  # a window without the answer points at [CLS]
            assert (feature["start_positions"], feature["end_positions"]) == (0, 0)
            assert feature["input_ids"][0] == tokenizer.cls_token_id
        assert len(feature["input_ids"]) <= 48


def test_best_span_stays_in_the_context_and_ends_after_it_starts():
    offsets = [None, None, (0, 3), (4, 7), (8, 11), None]
    start = np.array([9.0, 0, 1, 5, 0, 9.0])  # the highest scores sit on non-context tokens
    end = np.array([9.0, 0, 4, 0, 3, 9.0])
    assert best_span(start, end, offsets) == (8.0, 4, 11)  # "cat sat": start 3 (5) + end 4 (3); end 2 is before
    assert best_span(start, end, [None] * 6) is None


def test_each_task_evaluates_to_known_keys(tokenizer, sample_data):
    rows = {
        "seq-cls": Dataset.from_list(
            [
                {"question": "q?", "passage": "x = 1", "label": 1},
                {"question": "q?", "passage": "Some prose.", "label": 0},
            ]
        ),
        "qa": squad_rows_for_test(),
    }
    expected = {
        "mlm": {"eval_loss", "eval_perplexity"},
        "clm": {"eval_loss", "eval_perplexity"},
        "seq-cls": {"eval_loss", "eval_accuracy"},
        "qa": {"eval_loss", "eval_exact_match", "eval_f1"},
    }
    for name, task in TASKS.items():
        args = DatasetArguments(task=name, dataset_path=str(sample_data / "tokenized"))
        model, _ = build_model(args, tokenizer, seed=0)
        lm = name in ("mlm", "clm")
        data = task.validation(args, tokenizer, 4) if lm else task.prepare(rows[name], tokenizer, args)
        metrics = task.evaluate(model, data, tokenizer)
        assert set(metrics) == expected[name] and set(metrics) <= EVAL_KEYS
        assert all(isinstance(v, float) and np.isfinite(v) for v in metrics.values())


def test_classification_rejects_wrong_columns_and_labels(tokenizer):
    prepare = TASKS["seq-cls"].prepare
    with pytest.raises(SetupError, match="--task: seq-cls needs columns question, passage and label"):
        prepare(Dataset.from_list([{"sentence": "x", "label": 0}]), tokenizer, DatasetArguments(task="seq-cls"))
    with pytest.raises(SetupError, match="--num_labels: labels must be 0..1"):
        prepare(Dataset.from_list([{"text": "x", "label": 3}]), tokenizer, DatasetArguments(task="seq-cls"))
    with pytest.raises(SetupError, match="--dataset_path: --task qa needs SQuAD's columns"):
        TASKS["qa"].prepare(Dataset.from_list([{"text": "x"}]), tokenizer, DatasetArguments(task="qa"))


def test_every_task_starts_from_a_local_pretrained_folder(tokenizer, tmp_path, caplog):
    folder = tmp_path / "bert"
    pretrained, _ = build_model(DatasetArguments(), tokenizer, seed=1)
    pretrained.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    embeddings = pretrained.bert.embeddings.word_embeddings.weight
    new_heads = {"seq-cls": "classifier", "qa": "qa_outputs"}
    for task in TASKS:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="trainer.model"):
            model, _ = build_model(DatasetArguments(task=task, model_name_or_path=str(folder)), tokenizer, seed=0)
        assert np.allclose(model.get_input_embeddings().weight.detach(), embeddings.detach())  # weights loaded
        if task in new_heads:
            assert f"{new_heads[task]}.weight" in caplog.text and "initialised" in caplog.text


def test_a_model_without_the_head_names_the_task_flag(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path / "gpt")
    tokenizer = load_tokenizer(DatasetArguments())
    with pytest.raises(SetupError, match="--task: gpt2 models have no mlm head"):
        build_model(DatasetArguments(task="mlm", model_name_or_path=str(tmp_path / "gpt")), tokenizer, seed=0)


def test_synthetic_rows_are_learnable_by_design():
    rows = boolq_rows(["x = f(y)", "return 1"], ["Some prose about files.", "More prose."], 4)
    assert [r["label"] for r in rows] == [1, 0, 1, 0] and rows[1]["passage"] == "Some prose about files."
    context = "Return the pickle of an object."
    match = answer_word(context)
    assert match and context.count(match.group()) == 1
    (row,) = squad_rows([context], 1)
    start = row["answers"]["answer_start"][0]
    assert context[start : start + len(row["answers"]["text"][0])] == row["answers"]["text"][0]
    assert row["answers"]["text"][0].lower() in row["question"]


def test_predict_prints_a_span_and_a_label_and_rejects_bad_input(tokenizer, tmp_path, capsys):
    for task in ("qa", "seq-cls"):
        model, _ = build_model(DatasetArguments(task=task), tokenizer, seed=0)
        model.save_pretrained(tmp_path / task)
        tokenizer.save_pretrained(tmp_path / task)
    assert (
        predict_main(
            [
                "--checkpoint",
                str(tmp_path / "qa"),
                "--task",
                "qa",
                "--question",
                "where is pickle?",
                "--context",
                CONTEXT,
            ]
        )
        == 0
    )
    span = capsys.readouterr().out.strip()
    assert span and span in CONTEXT.lower()
    assert predict_main(["--checkpoint", str(tmp_path / "seq-cls"), "--task", "seq-cls", "--text", "x = 1"]) == 0
    label, probability = capsys.readouterr().out.split()
    assert label.startswith("LABEL_") and 0.5 <= float(probability) <= 1
    assert predict_main(["--checkpoint", str(tmp_path / "qa"), "--task", "qa", "--context", "c"]) == 2
    assert (
        capsys.readouterr().err.strip() == "python -m trainer.predict: error: --question: required (non-empty) "
        "for --task qa"
    )
    assert predict_main(["--checkpoint", str(tmp_path / "nothing"), "--task", "qa"]) == 2
    assert "--checkpoint: no saved model" in capsys.readouterr().err


def test_task_flag_is_a_choice(tmp_path):
    from arguments import parse_args
    from collab.errors import ConfigError

    with pytest.raises(ConfigError, match="--task: invalid choice"):
        parse_args([DatasetArguments], ["--task", "ner"])
    (args,) = parse_args([DatasetArguments], ["--task", "seq-cls"])
    assert args.task == "seq-cls"
    with pytest.raises(ConfigError, match="--doc_stride"):
        DatasetArguments(max_seq_length=64, doc_stride=32)
    assert json.dumps(args.__dict__)
