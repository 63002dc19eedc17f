"""One peer on all of a machine's devices: the ranks that ``torchrun --nproc_per_node N run_trainer.py ...`` starts.

Rank 0 is the peer the swarm sees: it alone runs hivemind (DHT, optimizer, state downloads, metrics, backups, events,
the saved model). Every rank computes gradients on its own data. Each optimizer step (a mini-step) goes:

1. ``RankSync.start_step``: rank 0 broadcasts whether to go on, its global epoch, its loss scale and its parameters,
   so every rank starts the step from rank 0's parameters (a state download, a delayed update or a rollback on rank 0
   reaches the others here, a step later at the latest);
2. every rank runs forward and backward on its own mini-batches;
3. ``RankSync.reduce_gradients``: gradients and losses are averaged across ranks before rank 0 unscales, clips and
   steps, so rank 0's optimizer gets the mean gradient of ``world_size`` times its own samples.

Parameters go out at every mini-step, changed or not: as many bytes as the gradients, over the machine's own links
(NVLink or PCIe between GPUs), and never wrong after a change that only rank 0 saw.

With ``--shard_model`` (``ShardedRankSync``) every rank holds only its shard of the model on its device (FSDP2's
``fully_shard``, the ZeRO-3 of the seeds), and rank 0 keeps the whole model in host memory for hivemind: step 1
sends rank 0's parameters out and each rank keeps its shard; step 3 gathers the ranks' mean gradients, already
reduced into shards by FSDP, whole into rank 0's host model.

A plain ``python run_trainer.py`` is one process without torch.distributed: ``ALONE``, and every exchange is a no-op.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from collab import events, signals
from collab.errors import SetupError

logger = logging.getLogger(__name__)

MAX_RANKS = 1024  # torchrun's --nproc_per_node on one machine; a larger WORLD_SIZE is not a machine's devices
BUCKET_ELEMENTS = 1 << 24  # values per collective (64 MiB of fp32): bounds the extra memory of flattening
GLOO_RELEASE_SECONDS = 1.0  # the longest wait for gloo's worker thread to let go of a finished collective's tensor
GLOO_WORKER_THREAD_NAME = "pt_gloo_runloop"  # what ProcessGroupGloo names its worker threads (/proc/self/task/*/comm)


@dataclass(frozen=True)
class Ranks:
    """This process's place in its peer: rank ``rank`` of ``world_size`` processes on this machine."""

    rank: int = 0
    world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


ALONE = Ranks()


def _env_int(env: Mapping[str, str], name: str, low: int, high: int) -> int:
    value = env.get(name, "")
    if not (value.isascii() and value.isdigit() and low <= int(value) <= high):
        raise SetupError(f"torchrun: {name} must be an integer from {low} to {high} (got {value[:20]!r})")
    return int(value)


def ranks_from_env(env: Mapping[str, str]) -> Ranks:
    """The ranks torchrun describes in ``env`` (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE); ``ALONE`` without
    WORLD_SIZE (plain python) or with one process. SetupError for a layout that is not one machine's processes."""
    if "WORLD_SIZE" not in env:
        return ALONE
    world_size = _env_int(env, "WORLD_SIZE", 1, MAX_RANKS)
    if world_size == 1:
        return ALONE
    rank = _env_int(env, "RANK", 0, world_size - 1)
    local_world_size = _env_int(env, "LOCAL_WORLD_SIZE", 1, MAX_RANKS)
    if local_world_size != world_size:
        raise SetupError(
            f"torchrun: one machine is one peer, but WORLD_SIZE {world_size} spans machines (LOCAL_WORLD_SIZE "
            f"{local_world_size}): run one torchrun per machine, each with --nnodes 1 --nproc_per_node <its GPUs>"
        )
    if _env_int(env, "LOCAL_RANK", 0, world_size - 1) != rank:
        raise SetupError(f"torchrun: LOCAL_RANK must equal RANK on one machine (got RANK {rank})")
    return Ranks(rank, world_size)


_joined = ALONE  # like torch.distributed's own default group: one per process


def current() -> Ranks:
    """The ranks of this process's peer (``ALONE`` outside ``process_group``)."""
    return _joined


def training_device(ranks: Ranks | None = None) -> torch.device:
    """Rank r's GPU (cuda:r; cuda:0 for a plain peer) when the machine has GPUs, else the CPU."""
    ranks = current() if ranks is None else ranks
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if ranks.rank >= torch.cuda.device_count():
        raise SetupError(
            f"torchrun: rank {ranks.rank} has no GPU of its own (this machine shows {torch.cuda.device_count()}): "
            "give --nproc_per_node at most the number of GPUs"
        )
    return torch.device("cuda", ranks.rank)


@contextlib.contextmanager
def process_group(ranks: Ranks, timeout: float | None) -> Iterator[None]:
    """torch.distributed among the peer's ranks for the ``with`` block (nothing for ``ALONE``): NCCL on GPUs, gloo on
    CPUs. A collective that waits more than ``timeout`` seconds for another rank fails, and this rank exits
    (``timeout`` is None only for ``ALONE``)."""
    global _joined
    if not ranks.distributed:
        yield
        return
    device = training_device(ranks)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        timeout=datetime.timedelta(seconds=timeout),
        device_id=device if device.type == "cuda" else None,
    )
    _joined = ranks
    keep_children_out_of_group_signals()
    logger.info("Rank %d of %d on %s; rank 0 talks to the swarm", ranks.rank, ranks.world_size, device)
    try:
        yield
    finally:
        _joined = ALONE
        dist.destroy_process_group()
        if device.type == "cpu" and gloo_worker_threads() > 0:
            # DTensor's caches (the sharded path) keep the group alive past destroy_process_group, so its worker
            # threads are not joined: give each the GIL to drop the collective it finished (``run_to_release``)
            # before the interpreter shuts down, where taking it aborts the process. A fixed wait: nothing this
            # process can read tells an idle worker from one about to take the GIL
            time.sleep(GLOO_RELEASE_SECONDS)


def gloo_worker_threads() -> int:
    """How many of this process's threads are gloo's worker threads (0 where /proc is not Linux's)."""
    try:
        tasks = list(Path("/proc/self/task").iterdir())
    except OSError:
        return 0
    return sum(_thread_name(task) == GLOO_WORKER_THREAD_NAME for task in tasks)


def _thread_name(task: Path) -> str:
    try:
        return (task / "comm").read_text().strip()
    except OSError:  # the thread ended meanwhile
        return ""


def keep_children_out_of_group_signals() -> None:
    """Every process this one forks from now on (hivemind's DHT and averagers, data loader workers) gets a process
    group of its own.

    torchrun stops a rank by signalling the rank's whole process group: a child in it would die at once while its
    rank finishes its step. hivemind's helpers also leave the group by themselves (``collab.hivemind_fixes``); this
    covers every other child of a rank (data loader workers)."""
    os.register_at_fork(after_in_child=signals.leave_the_process_group)


def rank_events_path(events_path: str | None, rank: int) -> str | None:
    """Rank r > 0 writes its events next to rank 0's: ``peer.events.jsonl`` -> ``peer.events.rank1.jsonl``."""
    if events_path is None or rank == 0:
        return events_path
    path = Path(events_path)
    return str(path.with_name(f"{path.stem}.rank{rank}{path.suffix}"))


@dataclass(frozen=True)
class StepStart:
    """What rank 0 tells every rank before a mini-step."""

    keep_going: bool
    epoch: int  # rank 0's global epoch
    loss_scale: float  # fp16 loss scale rank 0's backward uses (1.0 without), so every rank scales alike


def buckets(tensors: Sequence[torch.Tensor], max_elements: int = BUCKET_ELEMENTS) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by dtype, in order, each group cut into runs of at most ``max_elements`` values (a larger
    tensor is a run of its own): one flat buffer and one collective each."""
    by_dtype: dict[torch.dtype, list[list[torch.Tensor]]] = {}
    for tensor in tensors:
        runs = by_dtype.setdefault(tensor.dtype, [[]])
        if runs[-1] and sum(t.numel() for t in runs[-1]) + tensor.numel() > max_elements:
            runs.append([])
        runs[-1].append(tensor)
    return [run for runs in by_dtype.values() for run in runs]


@torch.no_grad()
def flat_collective_(tensors: Sequence[torch.Tensor], collective: Callable[[torch.Tensor], None]) -> None:
    """Run ``collective`` in place on the values of ``tensors``, one flat buffer per bucket, and copy them back."""
    for run in buckets(tensors):
        flat = torch.cat([tensor.reshape(-1) for tensor in run])
        run_to_release(collective, flat)
        for tensor, values in zip(run, flat.split([tensor.numel() for tensor in run]), strict=True):
            tensor.copy_(values.view_as(tensor))


def run_to_release(collective: Callable[[torch.Tensor], None], tensor: torch.Tensor) -> None:
    """``collective(tensor)``, returned from only once the backend holds no reference to ``tensor``.

    gloo (CPU tensors) marks a collective done before its worker thread drops the tensor, and dropping it takes the
    GIL: a rank that exits in between (its last step's broadcast) dies of SIGABRT in interpreter shutdown
    ("terminate called without an active exception") after a clean run. NCCL's threads stop at
    ``destroy_process_group``."""
    held = tensor._use_count()
    collective(tensor)
    if tensor.device.type != "cpu":
        return
    deadline = time.monotonic() + GLOO_RELEASE_SECONDS
    while tensor._use_count() > held and time.monotonic() < deadline:
        time.sleep(0.0005)  # lets the worker thread take the GIL


def parameters_checksum(model: torch.nn.Module) -> str:
    """The first 16 hex digits of the sha256 of the parameters' bytes, in order: equal on ranks with equal parameters.
    Costs one copy of the parameters to host memory."""
    return _checksum(param.detach() for param in model.parameters())


def _checksum(tensors: Iterable[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.reshape(-1).cpu().view(torch.uint8).numpy())
    return digest.hexdigest()[:16]


def shard(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model`` sharded across the peer's ranks in place (FSDP2), each shard on ``device``; returns it.

    Units: every module of a class the model names unsplittable (Hugging Face's ``_no_split_modules``: a
    transformer layer) that holds no tied parameter, then the rest as the root unit, where tied weights (an MLM
    head's decoder and the word embeddings) stay together. fully_shard moves one unit at a time to the device, so the
    whole model is never there at once."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # FSDP warns that an in-place op on a view it returns would skip its backward hook: the loop never does one
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    mesh = init_device_mesh(device.type, (current().world_size,))
    unsplittable = set(getattr(model, "_no_split_modules", None) or ())
    seen: set[int] = set()
    tied = set()
    for _, param in model.named_parameters(remove_duplicate=False):
        (tied if id(param) in seen else seen).add(id(param))
    for module in model.modules():
        if type(module).__name__ in unsplittable and not any(id(p) in tied for p in module.parameters()):
            fully_shard(module, mesh=mesh)
    return fully_shard(model, mesh=mesh)


class RankSync:
    """This rank's side of the per-mini-step exchange (module docstring); every method is a no-op for ``ALONE``.

    Each rank emits ``ranks_synced`` (docs/EVENTS.md) with a checksum of its parameters when a step starts in a new
    global epoch, to its own events file: ranks of one peer must report the same checksums."""

    sharded = False

    def __init__(self, model: torch.nn.Module, device: torch.device, ranks: Ranks | None = None):
        self.model, self.device = model, device
        self.ranks = current() if ranks is None else ranks
        self.epoch: int | None = None

    def start_step(self, start: StepStart | None) -> StepStart:
        """Rank 0 gives its ``start`` and gets it back; the others give None and get rank 0's, with its parameters."""
        if not self.ranks.distributed:
            return start
        sent = [float(start.keep_going), float(start.epoch), start.loss_scale] if self.ranks.rank == 0 else [0.0] * 3
        control = torch.tensor(sent, dtype=torch.float64, device=self.device)
        self._send_start(control)
        keep_going, epoch, loss_scale = control.tolist()
        start = StepStart(keep_going=bool(keep_going), epoch=int(epoch), loss_scale=loss_scale)
        if start.keep_going:
            self._receive_parameters()
            if start.epoch != self.epoch:
                self.epoch = start.epoch
                events.emit(
                    "ranks_synced",
                    rank=self.ranks.rank,
                    world_size=self.ranks.world_size,
                    epoch=start.epoch,
                    checksum=self._checksum(),
                    sharded=self.sharded,
                )
        return start

    def _send_start(self, control: torch.Tensor) -> None:
        """Rank 0's control values, and its parameters in the same exchange."""
        flat_collective_([control, *(param.data for param in self.model.parameters())], _broadcast_from_rank_0)

    def _receive_parameters(self) -> None:
        """Nothing more: the parameters came with the control values."""

    def _checksum(self) -> str:
        return parameters_checksum(self.model)

    def reduce_gradients(self, loss: float) -> float:
        """Average every parameter's gradient (a missing one counts as zeros) and ``loss`` across ranks; returns the
        mean loss. A rank's non-finite value makes the mean non-finite, so rank 0 drops the mini-batch for all."""
        if not self.ranks.distributed:
            return loss
        params = list(self.model.parameters())
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        loss_tensor = torch.tensor([loss], dtype=torch.float32, device=self.device)
        world_size = self.ranks.world_size

        def mean(flat: torch.Tensor) -> None:
            dist.all_reduce(flat)
            flat.div_(world_size)

        flat_collective_([*(param.grad for param in params), loss_tensor], mean)
        return loss_tensor.item()


def _broadcast_from_rank_0(flat: torch.Tensor) -> None:
    dist.broadcast(flat, src=0)


class ShardedRankSync(RankSync):
    """``RankSync`` for a model sharded across the ranks (``shard``; module docstring, ``--shard_model``).

    ``model`` is this rank's sharded model; rank 0 also gives ``swarm_model``, the same model whole in host memory:
    the one hivemind averages, steps, downloads and saves. Rank 0's ``ranks_synced`` checksum is that of
    ``swarm_model``, the other ranks' that of the model their shards assemble to."""

    sharded = True

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        swarm_model: torch.nn.Module | None = None,
        ranks: Ranks | None = None,
    ):
        super().__init__(model, device, ranks)
        self.shards = list(model.parameters())
        self.whole: dict[int, torch.Tensor] = {}
        if self.ranks.rank == 0:
            whole = list(swarm_model.parameters())
            if [tuple(p.shape) for p in whole] != [tuple(p.shape) for p in self.shards]:
                raise ValueError("swarm_model must be the sharded model's architecture, whole")
            self.whole = {id(shard): param for shard, param in zip(self.shards, whole, strict=True)}

    def _send_start(self, control: torch.Tensor) -> None:
        run_to_release(_broadcast_from_rank_0, control)

    @torch.no_grad()
    def _receive_parameters(self) -> None:
        """Rank 0's whole parameters, one flat bucket at a time, to every rank, which keeps its own shard (FSDP2
        shards dimension 0 as ``torch.chunk`` does)."""
        rank, world_size = self.ranks.rank, self.ranks.world_size
        for run in buckets(self.shards):
            flat = torch.empty(sum(shard.numel() for shard in run), dtype=run[0].dtype, device=self.device)
            if rank == 0:
                flat.copy_(torch.cat([self.whole[id(shard)].detach().reshape(-1) for shard in run]))
            run_to_release(_broadcast_from_rank_0, flat)
            for shard, values in zip(run, flat.split([shard.numel() for shard in run]), strict=True):
                chunks = values.view(shard.shape).chunk(world_size, dim=0)
                if rank < len(chunks):  # a tensor of fewer rows than ranks leaves the last ranks an empty shard
                    shard.to_local().copy_(chunks[rank])

    def _checksum(self) -> str:
        """Every rank assembles each tensor, one at a time (a collective); rank 0 reports its whole host model."""
        assembled = _checksum(shard.detach().full_tensor() for shard in self.shards)
        if self.ranks.rank != 0:
            return assembled
        return _checksum(self.whole[id(shard)].detach() for shard in self.shards)

    def reduce_gradients(self, loss: float) -> float:
        """FSDP has reduced each gradient to its mean across the ranks, in shards: assemble each tensor (a missing
        one counts as zeros) into rank 0's host model, then the mean loss."""
        if not self.ranks.distributed:
            return loss
        for shard in self.shards:
            if shard.grad is None:
                shard.grad = torch.zeros_like(shard)
        for shard in self.shards:
            gradient = shard.grad.full_tensor()
            if self.ranks.rank == 0:
                param = self.whole[id(shard)]
                if param.grad is None:
                    param.grad = torch.empty_like(param)
                param.grad.copy_(gradient)
        self.model.zero_grad(set_to_none=True)
        loss_tensor = torch.tensor([loss], dtype=torch.float32, device=self.device)
        run_to_release(dist.all_reduce, loss_tensor)
        return loss_tensor.item() / self.ranks.world_size
