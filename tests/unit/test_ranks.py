"""The ranks of a torchrun peer (trainer/ranks.py): the layout read from torchrun's environment, and the per-step
exchange run for real by two processes over gloo on 127.0.0.1, as torchrun would start them."""

from __future__ import annotations

import copy
import json
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from collab.errors import SetupError
from collab.events import read_events
from trainer.local import free_port
from trainer.ranks import ALONE, GLOO_RELEASE_SECONDS, Ranks, buckets, rank_events_path, ranks_from_env, run_to_release

TORCHRUN_ENV = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}


def test_plain_python_and_a_single_rank_are_one_process():
    assert ranks_from_env({}) == ALONE
    assert ranks_from_env({**TORCHRUN_ENV, "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}) == ALONE
    assert ranks_from_env(TORCHRUN_ENV) == Ranks(rank=1, world_size=2)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"WORLD_SIZE": "4"}, r"^torchrun: one machine is one peer, .* --nnodes 1 --nproc_per_node"),
        ({"RANK": "2"}, r"^torchrun: RANK must be an integer from 0 to 1 \(got '2'\)"),
        ({"WORLD_SIZE": "9" * 30}, r"^torchrun: WORLD_SIZE must be an integer from 1 to 1024 \(got '9{20}'\)"),
        ({"LOCAL_WORLD_SIZE": "-2"}, r"^torchrun: LOCAL_WORLD_SIZE must be an integer"),
        ({"LOCAL_RANK": "0"}, r"^torchrun: LOCAL_RANK must equal RANK"),
    ],
)
def test_a_layout_that_is_not_one_machine_is_refused_in_one_line(change, message):
    with pytest.raises(SetupError, match=message) as refused:
        ranks_from_env({**TORCHRUN_ENV, **change})
    assert "\n" not in str(refused.value)


def test_each_rank_writes_its_events_next_to_rank_0s():
    assert rank_events_path("out/peer.events.jsonl", 0) == "out/peer.events.jsonl"
    assert rank_events_path("out/peer.events.jsonl", 3) == "out/peer.events.rank3.jsonl"
    assert rank_events_path(None, 1) is None


def test_buckets_keep_order_by_dtype_and_cap_their_size():
    a, b, c = torch.zeros(3), torch.zeros(4), torch.zeros(2)
    half, control = torch.zeros(5, dtype=torch.float16), torch.zeros(3, dtype=torch.float64)
    assert [[t.numel() for t in run] for run in buckets([control, a, half, b, c], max_elements=7)] == [
        [3],
        [3, 4],
        [2],
        [5],
    ]
    assert [[t.numel() for t in run] for run in buckets([torch.zeros(10), a], max_elements=7)] == [[10], [3]]


def holding_collective(release: threading.Event) -> Callable[[torch.Tensor], None]:
    """A collective that returns at once while a worker thread keeps the tensor until ``release``, as gloo's does
    (through a view: a reference of torch's own, as a gloo work's, which a Python reference is not)."""

    def hold(view: torch.Tensor) -> None:
        release.wait()
        del view

    def collective(tensor: torch.Tensor) -> None:
        threading.Thread(target=hold, args=(tensor.view(-1),), daemon=True).start()

    return collective


def test_a_collective_returns_only_once_its_worker_thread_let_go_of_the_tensor():
    tensor, release, released_at = torch.zeros(3), threading.Event(), []

    def let_go() -> None:
        released_at.append(time.monotonic())
        release.set()

    started = time.monotonic()
    threading.Timer(0.3, let_go).start()
    run_to_release(holding_collective(release), tensor)
    returned = time.monotonic()
    # it returned after the worker let go (the release's own time: a timer started before `started` may fire sooner
    # than 0.3 s after it) and before the bound
    assert released_at and released_at[0] <= returned < started + GLOO_RELEASE_SECONDS
    assert tensor._use_count() == 1  # the thread's reference is gone: nothing left to free at interpreter exit


def test_a_reference_never_let_go_delays_the_rank_a_bounded_time():
    tensor, release = torch.zeros(3), threading.Event()
    started = time.monotonic()
    run_to_release(holding_collective(release), tensor)
    assert GLOO_RELEASE_SECONDS <= time.monotonic() - started < GLOO_RELEASE_SECONDS + 1
    release.set()


def exchange(rank: int, port: int, out: str) -> None:
    """One rank of a two-rank peer (a spawned process): start a step, reduce gradients, stop; results to ``out``."""
    from collab import events
    from trainer.ranks import RankSync, StepStart, current, gloo_worker_threads, process_group

    os.environ.update({**TORCHRUN_ENV, "RANK": str(rank), "LOCAL_RANK": str(rank)})
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    events.open_event_log(rank_events_path(f"{out}/peer.events.jsonl", rank))
    torch.manual_seed(rank)  # different parameters on each rank before the first step
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    with process_group(ranks_from_env(os.environ), timeout=60):
        sync = RankSync(model, torch.device("cpu"))
        start = sync.start_step(StepStart(True, 7, 1024.0) if rank == 0 else None)
        after_start = [param.detach().clone() for param in model.parameters()]
        model[0].weight.grad = torch.full((2, 3), float(rank + 1))  # 1 on rank 0, 2 on rank 1
        model[0].bias.grad = None if rank == 0 else torch.full((2,), 4.0)  # no gradient on rank 0: zeros
        loss = sync.reduce_gradients(3.0 + rank)
        stop = sync.start_step(StepStart(False, 8, 1024.0) if rank == 0 else None)
        world_size = current().world_size
        gloo_threads = gloo_worker_threads()
    result = {
        "gloo_threads": [gloo_threads, gloo_worker_threads()],
        "start": [start.keep_going, start.epoch, start.loss_scale],
        "stop": [stop.keep_going, stop.epoch],
        "parameters": [param.tolist() for param in after_start],
        "weight_grad": model[0].weight.grad.tolist(),
        "bias_grad": model[0].bias.grad.tolist(),
        "other_grad": model[1].weight.grad.tolist(),
        "loss": loss,
        "world_size": world_size,
        "after": current().world_size,
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.timeout(180)
def run_two_ranks(target, out: Path) -> tuple[dict, dict]:
    """``target(rank, port, out)`` in two spawned processes, as torchrun starts ranks (fresh, nothing inherited); the
    results each wrote to ``out``."""
    context = multiprocessing.get_context("spawn")
    port = free_port()
    ranks = [context.Process(target=target, args=(rank, port, str(out))) for rank in (0, 1)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(150)
    assert [process.exitcode for process in ranks] == [0, 0]
    rank_0, rank_1 = (json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1))
    return rank_0, rank_1


def test_two_ranks_start_each_step_from_rank_0s_parameters_and_average_their_gradients(tmp_path):
    rank_0, rank_1 = run_two_ranks(exchange, tmp_path)

    assert rank_0["start"] == rank_1["start"] == [True, 7, 1024.0]  # rank 0's word reaches rank 1
    assert rank_0["stop"] == rank_1["stop"] == [False, 8]
    assert rank_0["parameters"] == rank_1["parameters"]  # rank 1 took rank 0's parameters
    torch.manual_seed(0)
    assert rank_0["parameters"][0] == torch.nn.Linear(3, 2).weight.tolist()  # ... not the other way round
    for result in (rank_0, rank_1):
        assert result["weight_grad"] == [[1.5] * 3] * 2  # the mean of 1 and 2
        assert result["bias_grad"] == [2.0, 2.0]  # the mean of zeros and 4
        assert result["other_grad"] == [[0.0, 0.0]]  # no rank had one: zeros
        assert result["loss"] == 3.5
        assert (result["world_size"], result["after"]) == (2, 1)  # ALONE again after the group
        assert result["gloo_threads"][0] > 0 and result["gloo_threads"][1] == 0  # joined when the group ends

    events_path = str(tmp_path / "peer.events.jsonl")
    synced = [read_events(rank_events_path(events_path, rank), "ranks_synced") for rank in (0, 1)]
    assert [[(e["rank"], e["epoch"], e["sharded"]) for e in records] for records in synced] == [
        [(0, 7, False)],
        [(1, 7, False)],
    ]  # not at stop
    assert synced[0][0]["checksum"] == synced[1][0]["checksum"]


def sharded_exchange(rank: int, port: int, out: str) -> None:
    """One rank of a two-rank peer with --shard_model (a spawned process): each rank computes on its shard of a
    small MLP; rank 0 also holds the whole model in host memory. One step; results to ``out``."""
    from collab import events
    from trainer.ranks import ShardedRankSync, StepStart, gloo_worker_threads, process_group, shard

    os.environ.update({**TORCHRUN_ENV, "RANK": str(rank), "LOCAL_RANK": str(rank)})
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    events.open_event_log(rank_events_path(f"{out}/peer.events.jsonl", rank))
    torch.manual_seed(rank)  # different parameters on each rank: rank 1's must become rank 0's
    whole = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    with process_group(ranks_from_env(os.environ), timeout=60):
        sharded = shard(copy.deepcopy(whole), torch.device("cpu"))
        local_rows = [param.to_local().shape[0] for param in sharded.parameters()]
        sync = ShardedRankSync(sharded, torch.device("cpu"), whole if rank == 0 else None)
        sync.start_step(StepStart(True, 7, 1.0) if rank == 0 else None)
        assembled = [param.detach().full_tensor().tolist() for param in sharded.parameters()]
        loss = sharded(torch.full((4, 3), rank + 1.0)).sum()
        loss.backward()
        mean_loss = sync.reduce_gradients(loss.item())
        sync.start_step(StepStart(False, 8, 1.0) if rank == 0 else None)
    result = {"local_rows": local_rows, "assembled": assembled, "loss": loss.item(), "mean_loss": mean_loss}
    result["gloo_threads_after"] = gloo_worker_threads()
    if rank == 0:
        result["whole"] = [param.tolist() for param in whole.parameters()]
        result["whole_grads"] = [param.grad.tolist() for param in whole.parameters()]
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.timeout(180)
def test_sharded_ranks_compute_on_rank_0s_parameters_and_rank_0_gets_the_mean_gradient_whole(tmp_path):
    rank_0, rank_1 = run_two_ranks(sharded_exchange, tmp_path)

    # each rank holds half of each tensor's rows (a tensor of one row: all on rank 0, none on rank 1)
    assert rank_0["local_rows"] == [3, 3, 1, 1] and rank_1["local_rows"] == [2, 2, 0, 0]
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    expected = [param.tolist() for param in reference.parameters()]
    assert rank_0["whole"] == expected  # rank 0's host model, untouched by the step
    assert rank_0["assembled"] == rank_1["assembled"] == expected  # both ranks computed on rank 0's parameters
    # rank 0's host model gets the mean of both ranks' gradients: rank r's input is all r + 1
    for value in (1.0, 2.0):
        reference(torch.full((4, 3), value)).sum().backward()
    for got, want in zip(rank_0["whole_grads"], reference.parameters(), strict=True):
        assert torch.allclose(torch.tensor(got), want.grad / 2, atol=1e-6), (got, want.grad / 2)
    assert rank_0["mean_loss"] == pytest.approx((rank_0["loss"] + rank_1["loss"]) / 2)
    # DTensor's caches keep the group, and its worker threads, past its end: the case process_group waits out
    assert rank_0["gloo_threads_after"] > 0 and rank_1["gloo_threads_after"] > 0

    events_path = str(tmp_path / "peer.events.jsonl")
    synced = [read_events(rank_events_path(events_path, rank), "ranks_synced") for rank in (0, 1)]
    assert [[(e["epoch"], e["sharded"]) for e in records] for records in synced] == [[(7, True)], [(7, True)]]
    # rank 0 reports its host model, rank 1 what its shards assemble to: the same bytes
    assert synced[0][0]["checksum"] == synced[1][0]["checksum"]


def test_other_ranks_wait_as_long_as_rank_0s_model_and_link_need(tmp_path, sample_data):
    from arguments import PeerConfig, argument_groups, parse_args
    from bench.gpu import base_model_folder
    from trainer.follower import rank_wait_seconds

    def config(*argv: str) -> PeerConfig:
        return PeerConfig(*parse_args(argument_groups(PeerConfig), list(argv)))

    assert rank_wait_seconds(config("--ddp_timeout", "77")) == 77.0
    # the default model's transfers are shorter than every floor: 8 tries of 120 s and their backoffs (91 s), a
    # 60 s round and a shutdown of about 25 s
    assert 8 * 120 + 91 + 60 + 25 <= rank_wait_seconds(config()) < 8 * 120 + 91 + 60 + 27
    # a BERT-base shape at 10 Mbit/s: its state (89M parameters and Lamb's two moments, fp16: 535 MB) takes 428 s,
    # twice that for each of 8 tries
    slow = config("--model_name_or_path", str(base_model_folder(tmp_path)), "--bandwidth", "10")
    assert rank_wait_seconds(slow) > 8 * 2 * 428
