"""Averaging rounds that refuse non-finite values, so one groupmate cannot poison every peer's step.

hivemind averages whatever its groupmates send: one peer that sends inf or NaN in a gradient round makes every
peer's averaged gradients non-finite, and Lamb turns them into NaN parameters everywhere (the same through a
parameter round, which writes the average straight into the parameters). The classes here check both directions of
each all-reduce, inside the averager's own process, before anything is applied:

- what a groupmate sends to this peer to be averaged: its first part holding a non-finite value, or a non-finite or
  negative weight, drops that groupmate from the rest of the round on this peer (hivemind's own path for a sender that
  stops answering), so the other peers still average among themselves. That groupmate keeps its own values for the
  parts this peer reduces.
- what a groupmate sends back as the average of the part it reduces: each non-finite value is replaced by this
  peer's own value, as hivemind does for a part whose reducer failed.

A round with anything dropped logs one WARNING naming its kind (gradient or parameter round). The round itself goes
on, so nothing is raised into the training loop. This peer's own values are not checked here: they are its own
(the callback rolls back non-finite parameters, the loop drops a NaN loss).

Limits. Only non-finite values are refused: a groupmate can still send finite garbage (huge, wrong-signed or random
gradients, parameters of another model, an inflated weight that gives it nearly all of the average), and the
average moves by its share; a reducer can send back a finite wrong average for the part it reduces, and its own
finite values always enter that part. hivemind does not authenticate averaging traffic: any peer ID may join a group,
a new one costs nothing, so a refused peer comes back under another identity, or several at once. A refused peer is
refused for the rest of that round only. Bounding a contribution (median or trimmed mean, norm clipping) would need
every peer to see all contributions of a part, which butterfly all-reduce does not give.

The subclasses keep hivemind's RPC names (hivemind names each handler after the class), so they average with plain
hivemind averagers and the monitor's ``TrainingStateAverager`` can still download their state.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import hivemind
import torch
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.partition import BannedException, TensorPartReducer
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import as_aiter, azip

from collab.callback import all_finite

logger = logging.getLogger(__name__)


def is_acceptable_contribution(tensor_part: torch.Tensor, weight: float) -> bool:
    """Whether a groupmate's part may enter an average: finite values and a finite, non-negative weight."""
    return math.isfinite(weight) and weight >= 0 and all_finite([tensor_part])


@torch.no_grad()
def keep_local_where_non_finite(delta: torch.Tensor) -> tuple[torch.Tensor, int]:
    """An all-reduce result (``average - local``) with each non-finite value replaced by 0, so that this peer keeps
    its own value there, and how many were replaced."""
    if all_finite([delta]):
        return delta, 0
    finite = torch.isfinite(delta)
    return torch.where(finite, delta, torch.zeros((), dtype=delta.dtype)), int(finite.numel() - finite.sum())


class FiniteTensorPartReducer(TensorPartReducer):
    """hivemind's reducer, refusing a groupmate from the first part it sends with a non-finite value or weight.

    Raising ``BannedException`` makes the ``AllReduceRunner`` ban that sender (``_ban_sender``) exactly as it bans one
    that stops sending: the parts still to come are averaged without it. ``trusted_sender_index`` is this peer's own
    index, never checked (see the module docstring).
    """

    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int, trusted_sender_index: int | None):
        super().__init__(part_shapes, num_senders)
        self.trusted_sender_index = trusted_sender_index
        self.refused_senders: set[int] = set()

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        if sender_index != self.trusted_sender_index and not is_acceptable_contribution(tensor_part, weight):
            self.refused_senders.add(sender_index)
            raise BannedException(f"sender {sender_index} sent non-finite values or weight in part {part_index}")
        return await super().accumulate_part(sender_index, part_index, tensor_part, weight=weight)


class FiniteAllReduceRunner(AllReduceRunner):
    """hivemind's all-reduce with a ``FiniteTensorPartReducer`` and non-finite averaged values kept local; one
    WARNING per round that dropped anything, naming ``round_kind``."""

    def __init__(self, *, round_kind: str, **kwargs):
        super().__init__(**kwargs)
        self.round_kind = round_kind
        own_index = self.sender_peer_ids.index(self.peer_id) if self.peer_id in self.sender_peer_ids else None
        unused = self.tensor_part_reducer
        unused.finished.set()  # never used: its finalizer would report that it received none of its parts
        self.tensor_part_reducer = FiniteTensorPartReducer(unused.part_shapes, unused.num_senders, own_index)

    async def run(self):
        kept_local = 0
        try:
            async for delta in super().run():
                delta, replaced = keep_local_where_non_finite(delta)
                kept_local += replaced
                yield delta
        finally:
            self._report_dropped(kept_local)

    def _report_dropped(self, kept_local: int) -> None:
        refused = [str(self.sender_peer_ids[index]) for index in sorted(self.tensor_part_reducer.refused_senders)]
        if refused or kept_local:
            logger.warning(
                "%s round: dropped the contribution of %d groupmate(s) that sent non-finite values (%s); kept this "
                "peer's own value for %d non-finite averaged value(s)",
                self.round_kind.capitalize(),
                len(refused),
                ", ".join(refused) or "none",
                kept_local,
            )


def hivemind_class(cls: type) -> type:
    """The first hivemind class in ``cls``'s method resolution order."""
    return next(base for base in cls.__mro__ if base.__module__.startswith("hivemind."))


class FiniteAveragingMixin:
    """Runs this averager's all-reduce rounds with ``FiniteAllReduceRunner``; put it before the hivemind class."""

    round_kind: str  # named in the warning of a round that dropped values

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        """hivemind's RPC names (``{namespace}::GradientAverager.rpc_...``), not the subclass's: peers and monitors
        that run hivemind's classes must still reach this averager."""
        return hivemind_class(cls)._get_handle_name(namespace, method_name)

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id: bytes | None = None, **kwargs):
        """hivemind's ``DecentralizedAverager._run_allreduce_inplace_`` with ``FiniteAllReduceRunner``."""
        group_id = group_info.group_id if group_id is None else group_id
        runner = FiniteAllReduceRunner(
            round_kind=self.round_kind,
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        assert group_id in self._running_groups, f"Group id {group_id} was not registered in _register_allreduce_group"
        self._running_groups[group_id].set_result(runner)

        if runner.modes[group_info.peer_ids.index(self.peer_id)] != AveragingMode.AUX:
            async for tensor, update in azip(as_aiter(*tensors), runner):
                tensor.add_(update, alpha=self._averaging_alpha)
                self.last_updated = get_dht_time()
                self._state_updated.set()
        else:
            async for _ in runner:
                raise ValueError("aux peers should not receive averaged tensors")


class FiniteGradientAverager(FiniteAveragingMixin, GradientAverager):
    """hivemind's ``GradientAverager`` whose rounds refuse non-finite values (``grad_averager_factory=``)."""

    round_kind = "gradient"


class FiniteTrainingStateAverager(FiniteAveragingMixin, TrainingStateAverager):
    """hivemind's ``TrainingStateAverager`` whose parameter rounds refuse non-finite values."""

    round_kind = "parameter"


class FiniteAveragingOptimizer(hivemind.Optimizer):
    """``hivemind.Optimizer`` whose parameter rounds run in a ``FiniteTrainingStateAverager``; pass
    ``grad_averager_factory=FiniteGradientAverager`` for its gradient rounds."""

    def _make_state_averager(self, **kwargs) -> TrainingStateAverager:
        """hivemind's ``Optimizer._make_state_averager``, with ``FiniteTrainingStateAverager``."""
        return FiniteTrainingStateAverager(
            dht=self.dht,
            prefix=f"{self.run_id}_state_averager",
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            **kwargs,
        )
