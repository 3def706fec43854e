"""What a router session may do and decide (src/runtime/session.py): the mapper routes it may use, each bound to its sender
and receiver once (`bind`: a refusal — artifact mismatch, sliding-window receiver — is kept as the route's reason), the
policy (map | reprefill | auto, the levers, the length and magnitude guards; from config: `policy_from`) and the
measured costs behind `auto`. A session checks each route once against its own models (`check_route`: a route
refused at binding warns, `RouteRefusedWarning`).

The length guard (`Policy.length_guard`): `evidence` refuses to map a history longer than the mapper's measured
`max_verified_length` (its manifest's length evidence, src/artifact.py; `python -m src.length_evidence`) and, for a
mapper without evidence, falls back to the factor rule; `factor` refuses positions past `max_length_factor` × the
mapper's calibration sequence length; `off` maps at any length (a measurement run that must see every length);
`length_refusal` says why it refuses a piece.
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from numbers import Real

import numpy as np
import torch
from transformers import PreTrainedModel

from src.apply import KVTransfer
from src.artifact import ArtifactError, Mapper, length_evidence
from src.maps import TransferError
from src.models import KVInterface, describe_kv, fingerprint
from src.pair_check import ModelView, check_pair
from src.runtime.plan import NO_LEVERS, Levers

MODES = ("map", "reprefill", "auto")
LENGTH_GUARDS = ("evidence", "factor", "off")  # module docstring
MAX_LENGTH_FACTOR = 8.0  # the length guard's default: the factor the project's workloads calibrate for


@dataclass
class CostModel:
    """Measured costs, ms ≈ fixed + per_token · tokens per (receiver, kind), kind "map" (tokens mapped) or "prefill"
    (tokens read natively in one forward): a least-squares line through the last `window` observations."""

    window: int = 256
    samples: dict[tuple[str, str], list[tuple[int, float]]] = field(default_factory=dict)

    def observe(self, receiver: str, kind: str, tokens: int, ms: float) -> None:
        if tokens > 0:
            self.samples.setdefault((receiver, kind), []).append((tokens, ms))
            del self.samples[(receiver, kind)][: -self.window]

    def estimate(self, receiver: str, kind: str, tokens: int) -> float | None:
        """Predicted ms for `tokens`, or None before two different token counts were measured."""
        if tokens <= 0:
            return 0.0
        points = np.array(self.samples.get((receiver, kind), []), dtype=np.float64).reshape(-1, 2)  # [n, 2]
        if len(np.unique(points[:, 0])) < 2:
            return None
        slope, fixed = np.polyfit(points[:, 0], points[:, 1], 1)
        return float(max(fixed + slope * tokens, 0.0))


@dataclass(frozen=True)
class Policy:
    """How a session covers a receiver's unseen tokens. The length guard is on by default (the mapper's evidence,
    else `MAX_LENGTH_FACTOR`; module docstring); None switches a bound off explicitly."""

    mode: str = "map"  # MODES
    levers: Levers = NO_LEVERS  # target work kept native around the mapped span
    max_length_factor: float | None = MAX_LENGTH_FACTOR  # refuse positions past factor × the mapper's calibration
    guard_max_abs: float | None = None  # refuse a mapped span with any |K| or |V| above this
    length_guard: str = "evidence"  # LENGTH_GUARDS: the mapper's verified length, else the factor rule

    def __post_init__(self) -> None:
        if not isinstance(self.mode, str) or self.mode not in MODES:
            raise ValueError(f"policy mode must be one of {MODES}, not {self.mode!r}")
        if not isinstance(self.length_guard, str) or self.length_guard not in LENGTH_GUARDS:
            quoted = " (YAML reads a bare off as false: quote it)" if self.length_guard is False else ""
            raise ValueError(f"policy length_guard must be one of {LENGTH_GUARDS}, not {self.length_guard!r}{quoted}")
        if not isinstance(self.levers, Levers):
            raise ValueError(f"policy levers must be a Levers, not a {type(self.levers).__name__}")
        _check_bound("max_length_factor", self.max_length_factor, positive=True)
        _check_bound("guard_max_abs", self.guard_max_abs, positive=False)


def policy_from(node: Mapping) -> Policy:
    """The Policy of a `policy:` config node (conf/policy/default.yaml, `cfg.policy`): each key a field of Policy,
    `levers` a block of Levers fields — so a field added to either needs only its line in the YAML."""
    fields = dict(node)
    return Policy(**fields | {"levers": Levers(**fields["levers"])})


def _check_bound(name: str, value: object, positive: bool) -> None:
    """None (the guard is off) or a finite number > 0 (positive) / ≥ 0; else a ValueError naming the field."""
    if value is None:
        return
    number = isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
    if not number or value < 0 or (positive and value == 0):
        relation = "> 0" if positive else "≥ 0"
        raise ValueError(f"{name} must be a finite number {relation} or None (no guard), not {value!r}")


class RouteRefusedWarning(UserWarning):
    """A session holds a route whose bind was refused: every handoff that needs it re-prefills (status unsupported)."""


@dataclass(frozen=True)
class Route:
    """A sender → receiver mapper bound to both models once, or the reason it cannot be used."""

    transfer: KVTransfer | None
    mapper_id: str
    refusal: str | None  # why every handoff on this route re-prefills (status unsupported)
    calibrated_length: int | None  # tokens per calibration sequence (None: not recorded)
    verified_length: int | None = None  # the longest history its length evidence verifies (None: no evidence)
    verified_by: str | None = None  # the run that showed it (run id and record)


def length_refusal(policy: Policy, route: Route, history: int, end: int) -> str | None:
    """Why the length guard (`Policy.length_guard`) refuses to map a piece ending at position end − 1 of the
    conversation on `route`, or None. The evidence bounds the history (the conversation before the new turn, what its
    measurements binned); the factor rule bounds the mapped positions."""
    guard = policy.length_guard
    if guard == "evidence" and route.verified_length is not None:
        if history <= route.verified_length:
            return None
        shown = f"shown by {route.verified_by}" if route.verified_by else "no measured length passed"
        verified = route.verified_length
        return f"a history of {history} tokens is beyond the mapper's verified length {verified} ({shown})"
    limit = policy.max_length_factor
    if guard == "off" or limit is None or route.calibrated_length is None or end <= limit * route.calibrated_length:
        return None
    return f"position {end - 1} is beyond {limit:g} × the mapper's calibration length {route.calibrated_length}"


def check_route(sender: str, receiver: str, route: Route, models: dict[str, PreTrainedModel]) -> None:
    """A ValueError unless the route joins two of a session's `models` and its transfer was bound to them (the
    same objects, or the same fingerprint); a route whose bind was refused warns (RouteRefusedWarning)."""
    if sender not in models or receiver not in models:
        raise ValueError(f"route {sender} → {receiver} names a model the session does not hold")
    if not isinstance(route, Route):
        raise ValueError(f"route {sender} → {receiver} is a {type(route).__name__}, not a Route (routing.bind)")
    if (route.transfer is None) == (route.refusal is None):
        raise ValueError(f"route {sender} → {receiver} needs a transfer or a refusal, exactly one (routing.bind)")
    if route.transfer is None:
        warnings.warn(
            f"route {sender} → {receiver} was refused at binding ({route.refusal}): every handoff on it re-prefills",
            RouteRefusedWarning,
            stacklevel=3,
        )
        return
    for role, name, bound in (
        ("sender", sender, route.transfer.source),
        ("receiver", receiver, route.transfer.target),
    ):
        held = models[name]
        if bound is not held and fingerprint(bound) != fingerprint(held):
            raise ValueError(
                f"route {sender} → {receiver} was bound to another {role} than the session's {name!r}: "
                f"fingerprint {fingerprint(bound)[:12]} ≠ {fingerprint(held)[:12]} (bind the route to this model)"
            )


def mapper_id(mapper: Mapper) -> str:
    """The method and a digest of the manifest (which names the coefficients' pair, fit and calibration)."""
    digest = hashlib.sha256(json.dumps(mapper.manifest, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return f"{mapper.manifest.get('method', 'mapper')}:{digest}"


def window_refusal(receiver: KVInterface) -> str | None:
    """Why a sliding-window receiver cannot take a route (its cache keeps only the window), or None."""
    if receiver.sliding_window is None and set(receiver.layer_types) == {"full_attention"}:
        return None
    window = f"sliding-window receiver (window {receiver.sliding_window}, layers {sorted(set(receiver.layer_types))})"
    return f"unsupported: {window}: its cache keeps only the window"


def view_refusal(mapper: Mapper, sender: ModelView, receiver: ModelView, tokenizer_hash: str) -> str | None:
    """The refusal `bind` gives the route, or None, from the two models' views alone (src/pair_check.py): what a
    vLLM worker checks without loading the models (src/serving/routes.py)."""
    if window := window_refusal(receiver.kv):
        return window
    try:
        length_evidence(mapper.manifest)
        check_pair(mapper, sender, receiver, tokenizer_hash)
    except (TransferError, ArtifactError) as refusal:
        return f"mapper refused: {refusal}"
    return None


def bind(
    sender: PreTrainedModel,
    receiver: PreTrainedModel,
    mapper: Mapper,
    tokenizer_hash: str,
    compute_dtype: torch.dtype = torch.float32,
    backend: str = "torch",
) -> Route:
    """Verify the mapper against both models (KVTransfer), its length evidence (src/artifact.py `length_evidence`)
    and the receiver's attention; a refusal is kept as the route's reason, so every handoff on it re-prefills (status
    unsupported)."""
    identity = mapper_id(mapper)
    calibrated = mapper.manifest.get("calibration", {}).get("seq_len")
    if window := window_refusal(describe_kv(receiver)):
        return Route(None, identity, window, calibrated)
    try:
        evidence = length_evidence(mapper.manifest) or (None, None)
        transfer = KVTransfer(mapper, sender, receiver, tokenizer_hash, compute_dtype, backend)
    except (TransferError, ArtifactError) as refusal:
        return Route(None, identity, f"mapper refused: {refusal}", calibrated)
    return Route(transfer, identity, None, calibrated, *evidence)
