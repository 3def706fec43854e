"""One handoff of a router session (`Session.switch_to`, src/runtime/session.py): how the receiver's unseen tokens
are covered — re-prefilled (the policy, a refusal, levers that leave nothing to map, or the cheaper path under
`auto`) or mapped: the splice planned once (src/runtime/plan.py, its refusals first), each piece mapped
(src/runtime/pieces.py), the one splice run on the receiver (src/runtime/splice.py), its provenance kept — and the
`HandoffRecord` that says what happened. A map refused by its device flags (read after the tail's forward, or
before a recompute's choice) puts the receiver back and re-prefills, bit-identically to a session that never tried.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from src.maps import TransferError
from src.runtime.pieces import map_pieces, owners
from src.runtime.plan import SplicePlan, plan_splice, spent
from src.runtime.reader import Reader, Segment, clock, model_device
from src.runtime.routing import CostModel, Policy, Route
from src.runtime.splice import splice

PATHS = ("hit", "map", "reprefill")
STATUSES = ("applied", "fallback_reprefill", "unsupported")


@dataclass
class HandoffRecord:
    """One `switch_to`: what the receiver reused, mapped and prefilled, at what cost, and why.

    prefill_fraction is the share of a full prefill of the unseen tokens that the receiver spent: 1.0 whenever it
    re-prefilled them (the policy, a refusal, or levers that cover every token: `levers_cover_all`), the levers'
    share on a map (`Levers.prefill_fraction`, plus the native layers over the held prefix), 0.0 on a hit (nothing
    unseen: nothing spent). The new turn, always read natively, is not part of it."""

    sender: str | None
    receiver: str
    path: str  # PATHS: how the unseen tokens were covered (hit: there were none)
    status: str  # STATUSES
    reason: str
    context: int  # conversation tokens before the new turn
    hit: int  # tokens reused from the receiver's own cache
    mapped: int  # tokens mapped from another model's cache
    prefilled: int  # unseen tokens the receiver read natively (sink, hold-back, or all of them)
    turn: int  # new-turn tokens read natively after them
    prefill_fraction: float  # see the class docstring
    ms: float  # the whole switch: reuse + map / prefill + the new turn's logits
    ms_map: float  # the mapper calls within it
    bytes: int  # K/V bytes read from the senders' caches for the mapped tokens
    recomputed: int = 0  # mapped tokens recomputed in place (Levers.recompute)
    levers_cover_all: bool = False  # path reprefill because the levers' sink and hold-back left no token to map


@dataclass(frozen=True)
class Switch:
    """A `switch_to` as its cover sees the session: readers, routes, policy and costs; the conversation ids [T] before
    the new turn, the active model, the receiver's name and the new turn [N]."""

    readers: dict[str, Reader]
    routes: dict[tuple[str, str], Route]
    policy: Policy
    costs: CostModel
    ids: torch.Tensor
    active: str | None
    receiver: str
    turn: torch.Tensor


def reprefill(switch: Switch, record: HandoffRecord, status: str, reason: str) -> HandoffRecord:
    """The receiver reads the unseen tokens and the turn in one forward: what a session without transfers does."""
    reader = switch.readers[switch.receiver]
    began = clock(model_device(reader.model))
    native = torch.cat([switch.ids[record.hit :], switch.turn])
    reader.read(native)
    switch.costs.observe(switch.receiver, "prefill", native.numel(), (clock(model_device(reader.model)) - began) * 1e3)
    unseen = record.context - record.hit
    return replace(record, path="reprefill", status=status, reason=reason, prefilled=unseen, prefill_fraction=1.0)


def cover(switch: Switch, record: HandoffRecord) -> HandoffRecord:
    """Cover the receiver's unseen tokens record.hit..record.context − 1 (module docstring), then the turn."""
    policy, levers, model, turn, costs = switch.policy, switch.policy.levers, switch.receiver, switch.turn, switch.costs
    held, total = record.hit, record.context
    if policy.mode == "reprefill":
        return reprefill(switch, record, "applied", "policy: reprefill")
    sink_end = min(max(levers.native_sink, held), total)  # conversation positions < native_sink stay native
    hold = min(max(levers.hold_back, 0 if turn.numel() else 1), total - sink_end)  # no turn: the last is read
    end = total - hold
    if end <= sink_end:
        return reprefill(switch, replace(record, levers_cover_all=True), "applied", "the levers leave no token to map")
    owned = owners(switch.readers, switch.routes, switch.active, model, sink_end, end)
    if isinstance(owned, str):
        return reprefill(switch, record, "unsupported", owned)
    reader = switch.readers[model]
    unseen = total - held
    span = replace(levers, native_sink=sink_end - held, hold_back=hold)  # the levers on this span
    layers = reader.model.config.get_text_config().num_hidden_layers
    transfer = switch.routes[(owned[0][2], model)].transfer
    depth = min(span.native_depth(unseen), layers)
    spend = spent(transfer, span).prefill_fraction(unseen, layers, turn.numel()) * unseen + held * depth / layers
    if policy.mode == "auto":
        estimate_map = [costs.estimate(model, "map", end - sink_end), costs.estimate(model, "prefill",
                        round(spend) + turn.numel())]  # fmt: skip
        estimate_prefill = costs.estimate(model, "prefill", unseen + turn.numel())
        if None in estimate_map or estimate_prefill is None:
            reason = "auto: no cost measurements yet for this receiver, map by default"
        elif sum(estimate_map) >= estimate_prefill:
            reason = f"auto: re-prefill ≈ {estimate_prefill:.2f} ms ≤ map ≈ {sum(estimate_map):.2f} ms"
            return reprefill(switch, record, "applied", reason)
        else:
            reason = f"auto: map ≈ {sum(estimate_map):.2f} ms < re-prefill ≈ {estimate_prefill:.2f} ms"
    else:
        reason = "policy: map"
    receiver = reader.receiver()
    plan = plan_splice(span, held, unseen, turn.numel(), layers, transfer.token_features, receiver.capabilities)
    device = model_device(reader.model)
    began = clock(device)
    try:
        pieces, read = map_pieces(switch.readers, switch.routes, policy, switch.ids, model, owned)
    except TransferError as refusal:
        return reprefill(switch, record, "fallback_reprefill", str(refusal))
    ms_map = (clock(device) - began) * 1e3
    costs.observe(model, "map", end - sink_end, ms_map)
    saved, began = reader.save(), clock(device)
    tail = torch.cat([switch.ids[end:total], turn])[None]  # [1, hold-back + turn]
    try:
        logits = splice(plan, receiver, switch.ids[None, :end], pieces, tail, tail)
    except TransferError as refusal:  # a map's device flags (the tail read or not): back to what it held
        reader.restore(saved)
        return reprefill(switch, record, "fallback_reprefill", str(refusal))
    costs.observe(model, "prefill", round(spend) + turn.numel(), (clock(device) - began) * 1e3)
    provenance(switch, plan, owned, logits)
    mapped = end - sink_end
    return replace(record, path="map", reason=reason, mapped=mapped, prefilled=unseen - mapped,
                   prefill_fraction=spend / unseen, ms_map=ms_map, bytes=read, recomputed=plan.recomputed)  # fmt: skip


def provenance(switch: Switch, plan: SplicePlan, owned: list[tuple[int, int, str]], logits: torch.Tensor) -> None:
    """After a splice: the receiver's segments — the sink read natively, each mapped piece from its sender by its
    route's mapper, the hold-back and the turn read natively on top (not exact: after mapped K/V) — and its
    next-token logits."""
    reader = switch.readers[switch.receiver]
    if plan.start > plan.held:
        reader.add(Segment(plan.held, plan.start, "native", reader.exact))
    for low, high, sender in owned:
        reader.add(Segment(low, high, "mapped", False, sender, switch.routes[(sender, switch.receiver)].mapper_id))
    reader.add(Segment(plan.end, plan.end + plan.tail, "native", False))
    reader.logits = logits
