"""The receiver's decision, made once per request on vLLM's scheduler: a `SplicePlan` (src/runtime/plan.py, built by
`plan_splice` like every receiver's) mapping a block-aligned span [start, end) of the prompt from a sender's export,
or why none (then the request is an ordinary prefill).

vLLM has already found the receiver's own prefix hit (`hit` tokens, whole blocks): it comes first, and a mapped span
starts there — the only way a native sink can precede it. The span ends at the first of: the export's last token,
the prompt less `hold_back` tokens (at least one: the engine must compute a token to sample from), the start of a
span the sender itself held mapped (mapped K/V are never mapped again) — rounded down to a block. Refused, in this
order: policy mode `reprefill`; a sender tokenizer other than the receiver's; an export fingerprinted in another
dtype than the mapper's source (the sender's `fingerprint_dtype`: the refusal names the setting); an export of
another model than the mapper's source; exported ids that are not a prefix of the prompt; a native hit shorter than
the sink; a hit inside the sender's mapped span; nothing left to map (a prompt shorter than a block, or a hit that
covers the export); the length guard (`routing.length_refusal`: the history is what the sender held, the export).
Then the plan (`paged_plan`), whose own check (`check_splice` on `PAGED`) the connector's settings already passed at
start-up (src/serving/config.py runs `paged_plan` on a long prompt).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from src.runtime.plan import Capabilities, Levers, SplicePlan, plan_splice
from src.runtime.routing import Policy, Route, length_refusal
from src.serving.transport import Header

PAGED = Capabilities("vLLM's paged blocks (a load hook)", forward=False, rules=frozenset())  # writes mapped spans only


def paged_plan(levers: Levers, hit: int, end: int, prompt_len: int, layers: int) -> SplicePlan:
    """The plan of vLLM's paged blocks (`PAGED`) holding the `hit` tokens of vLLM's native prefix hit, given a prompt
    of `prompt_len` tokens, mapping hit..end − 1, over a target of `layers` layers; a ValueError (`check_splice`) for
    levers a receiver without a forward cannot run.

    The levers are realized on the paged blocks: no sink past the hit (the sink is served as the native hit:
    `claim` checked hit ≥ native_sink), and a hold-back of prompt_len − end with no turn — everything past the span
    (the policy's hold-back, the block-rounding remainder, what the export or the sender's mapped span leaves) is
    read natively on top of it by vLLM's own forward, which is the plan's hold-back; vLLM's prompt does not say where
    the new turn begins. So plan.start = hit, plan.end = end, plan.tail = prompt_len − end. Token features are
    False: a token-feature mapper is refused when the worker binds its routes (src/serving/routes.py)."""
    realized = replace(levers, native_sink=0, hold_back=prompt_len - end)
    return plan_splice(realized, hit, prompt_len - hit, 0, layers, False, PAGED)


def claim(
    prompt: Sequence[int],
    hit: int,
    header: Header,
    route: Route,
    source_fingerprint: str,
    fingerprint_dtype: str,
    policy: Policy,
    tokenizer_hash: str,
    block_size: int,
    layers: int,
) -> SplicePlan | str:
    """The plan of the span to map, or the reason there is none (module docstring). prompt: the request's token ids;
    hit: the receiver's native prefix hit (a multiple of block_size); route: the mapper's (its length evidence and
    calibration length); source_fingerprint: the model the mapper maps from, in fingerprint_dtype (its fit's
    pair.dtype); tokenizer_hash: the receiver's tokenizer; layers: the receiver's."""
    exported = len(header.ids)
    if policy.mode == "reprefill":
        return "policy: reprefill"
    if header.tokenizer_hash != tokenizer_hash:
        return (f"tokenizer mismatch: the sender's tokenizer {header.tokenizer_hash[:12]} ≠ the receiver's "
                f"{tokenizer_hash[:12]}")  # fmt: skip
    if header.fingerprint_dtype != fingerprint_dtype:  # the same files fingerprint differently in another dtype
        return (f"export {header.export_id} is fingerprinted in {header.fingerprint_dtype}, the mapper "
                f"{route.mapper_id}'s source in {fingerprint_dtype}: set the sender's kv_connector_extra_config "
                f"fingerprint_dtype to {fingerprint_dtype!r}")  # fmt: skip
    if header.source_fingerprint != source_fingerprint:
        return (f"export {header.export_id} comes from model {header.source_fingerprint[:12]}, the mapper "
                f"{route.mapper_id} maps from {source_fingerprint[:12]}")  # fmt: skip
    if exported > len(prompt) or list(header.ids) != list(prompt[:exported]):
        differ = next((i for i, (a, b) in enumerate(zip(header.ids, prompt, strict=False)) if a != b), len(prompt))
        return f"the export's {exported} token ids are not a prefix of the prompt ({len(prompt)} tokens; they differ at {differ})"
    sink = policy.levers.native_sink
    if hit < sink:
        return f"native_sink {sink}: the receiver holds {hit} tokens natively (a sink is served only as a native hit)"
    end = min(exported, len(prompt) - max(policy.levers.hold_back, 1))
    if header.mapped is not None:
        low, high = header.mapped
        if low <= hit < high:
            return f"the receiver's hit {hit} ends inside the sender's own mapped span {low}..{high - 1}"
        if hit < low:
            end = min(end, low)
    end = end // block_size * block_size
    if end <= hit:
        return (f"nothing to map: {len(prompt)} prompt tokens, {exported} exported, {hit} already cached, "
                f"block {block_size}")  # fmt: skip
    if refusal := length_refusal(policy, route, exported, end):
        return refusal
    return paged_plan(policy.levers, hit, end, len(prompt), layers)
