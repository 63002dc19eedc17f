"""The LocalMetrics record every trainer publishes once per global epoch, and the validators that guard it.

Key ``{experiment_prefix}_metrics``, subkey = the publishing peer's RSA public key, so only that peer can
overwrite its own record (RSASignatureValidator); SchemaValidator rejects any value that is not a strict
LocalMetrics: non-negative, finite, within the bounds below, the right types, no extra fields. The same schema
guards key ``{experiment_prefix}_repairs`` (collab/repairs.py): one signed epoch, an int in [0, MAX_STEP], per peer.

LocalMetrics is one pydantic v2 model (validated in compiled code: the monitor parses every peer's record on every
refresh); hivemind's SchemaValidator takes pydantic v1 models, so MetricSchema wraps the same model in a v1 field
type instead of restating the rules.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import Annotated

import pydantic.v1
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.validation import RecordValidatorBase
from hivemind.utils.crypto import RSAPrivateKey
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from collab.names import MAX_PUBLIC_NAME_CHARS, public_name_problem

logger = logging.getLogger(__name__)

# Upper bounds no honest peer reaches but that keep every sum and difference the monitor computes far from overflow:
# 2^40 global epochs is 35,000 years at one a second; 1e7 samples/s is thousands of GPUs in one peer.
MAX_STEP = 2**40 - 1
MAX_SAMPLES_PER_SECOND = 1e7
MAX_SAMPLES_ACCUMULATED = 2**40 - 1
MAX_MINI_STEPS = 10**7
# A mini-batch's loss (mean cross-entropy) is ln(vocabulary) ~ 10 at the start and stays below the largest fp16
# logit gap (~1.3e5) even when training diverges, so a sum above 1e6 per mini-step is never an honest one.
MAX_LOSS_PER_MINI_STEP = 1e6
# A peer's samples over its whole life: 1e15 is a thousand years at the per-peer samples/s bound above.
MAX_CONTRIBUTED_SAMPLES = 10**15


def _valid_public_name(name: str) -> str:
    problem = public_name_problem(name)
    if problem is not None:
        raise ValueError(problem)
    return name


# The length is checked first, in compiled code, so a hostile megabyte of text costs nothing more to refuse.
PublicName = Annotated[str, Field(max_length=MAX_PUBLIC_NAME_CHARS), AfterValidator(_valid_public_name)]


class LocalMetrics(BaseModel):
    """One peer's progress over its last global epoch. ``loss`` is the sum over ``mini_steps`` mini-batches.

    ``contributed_samples`` and ``contributed_epochs`` count what this peer (this key) did over every epoch it
    published, this one included; ``public_name`` is the name its volunteer chose (collab/names.py), if any. A record
    without them (an older peer) counts as contributing nothing. They are claims: the signature proves who, not how
    much.

    Strict: no strings, floats or booleans where an int belongs, nothing negative, no NaN or infinity, nothing past
    the MAX_* bounds, no extra fields (an int where a float belongs is a number and is accepted).
    """

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    step: int = Field(ge=0, le=MAX_STEP)
    samples_per_second: float = Field(ge=0.0, le=MAX_SAMPLES_PER_SECOND, allow_inf_nan=False)
    samples_accumulated: int = Field(ge=0, le=MAX_SAMPLES_ACCUMULATED)
    loss: float = Field(ge=0.0, allow_inf_nan=False)
    mini_steps: int = Field(ge=0, le=MAX_MINI_STEPS)
    contributed_samples: int = Field(default=0, ge=0, le=MAX_CONTRIBUTED_SAMPLES)
    contributed_epochs: int = Field(default=0, ge=0, le=MAX_STEP)
    public_name: PublicName | None = None

    @model_validator(mode="after")
    def _loss_is_bounded_per_mini_step(self) -> LocalMetrics:
        if self.loss > MAX_LOSS_PER_MINI_STEP * self.mini_steps:
            raise ValueError(f"loss must be at most {MAX_LOSS_PER_MINI_STEP:g} per mini-step (mini_steps)")
        return self

    def to_record(self) -> dict:
        """The value a peer stores: without ``public_name`` when it has none."""
        return self.model_dump(exclude_none=True)


class _LocalMetricsRecord:
    """LocalMetrics as a pydantic v1 field type: validates with the model and gives back the plain dict.

    hivemind's SchemaValidator compares the parsed value with the stored one, so a valid record must come back equal:
    fields the record left out (an older peer's) stay out.
    """

    @classmethod
    def __get_validators__(cls):
        yield lambda value: LocalMetrics.model_validate(value).model_dump(exclude_unset=True)


RepairEpoch = pydantic.v1.conint(strict=True, ge=0, le=MAX_STEP)


class MetricSchema(pydantic.v1.BaseModel):
    metrics: dict[BytesWithPublicKey, _LocalMetricsRecord]
    # a peer catching up asks for a parameter round at this global epoch (collab/repairs.py); a default, as
    # hivemind's SchemaValidator makes every field optional (it validates one key at a time)
    repairs: dict[BytesWithPublicKey, RepairEpoch] = pydantic.v1.Field(default_factory=dict)


def honest_step(steps: Sequence[int], step_lag: int) -> int:
    """The swarm's global step by its honest majority: the newest step at most ``step_lag`` past the lower median.

    A minority of records (one liar, or several) cannot move it by more than ``step_lag``, however far ahead they
    claim to be. The price: when most peers leave at once, their records hold the step at theirs until they are
    left out (the monitor counts only peers whose progress records live: ``monitor.aggregate.with_live_progress``),
    since a lone peer running ahead looks the same as a liar.
    """
    ordered = sorted(steps)
    limit = ordered[(len(ordered) - 1) // 2] + step_lag
    return max(step for step in ordered if step <= limit)


def peer_fingerprint(public_key: bytes) -> str:
    """A short, stable, printable name for a peer's public key (the key itself is hundreds of bytes)."""
    return hashlib.sha256(public_key).hexdigest()[:12]


def metrics_key(experiment_prefix: str) -> str:
    """The DHT key under which every peer of the experiment publishes its LocalMetrics."""
    return f"{experiment_prefix}_metrics"


def make_validators(
    experiment_prefix: str, private_key: RSAPrivateKey | None = None
) -> tuple[list[RecordValidatorBase], bytes]:
    """Validators for the experiment's records and this process's public key (the subkey it signs with)."""
    signature_validator = RSASignatureValidator(private_key)
    validators = [SchemaValidator(MetricSchema, prefix=experiment_prefix), signature_validator]
    return validators, signature_validator.local_public_key


def read_metrics(dht, experiment_prefix: str) -> dict[bytes, tuple[dict, float]]:
    """Raw metric records currently in the DHT: {peer public key: (value, expiration_time)}.

    Values are returned as stored; callers validate them (see ``parse_metrics``) because a record may have been
    written by an older or foreign client that the local validators did not see.
    """
    found = dht.get(metrics_key(experiment_prefix), latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    return {subkey: (entry.value, entry.expiration_time) for subkey, entry in found.value.items()}


def parse_metrics(value) -> LocalMetrics | None:
    """A LocalMetrics if ``value`` is a valid record, else None (malformed records are ignored, never raised)."""
    try:
        return LocalMetrics.model_validate(value)
    except Exception:
        return None
