"""Time to first token inside vLLM, per history length: the routed handoff (the sender's export + the receiver's
mapped claim) against vLLM's own re-prefill and vLLM's own prefix hit — timing only, never quality: random weights
of a pair's shapes, or (`--models`, `--mapper`) a real pair and its fitted mapper.

    python scripts/bench_vllm_ttft.py --pair conf/pair/qwen25coder_0p5b_to_1p5b_random.yaml \\
        --lengths 1024,2048,4096,8192,16384 --export-memory device --out results/vllm_ttft.json   # GPU: one device
    python scripts/bench_vllm_ttft.py --models /tmp/kvh/models/qwen25coder_0p5b /tmp/kvh/models/qwen25coder_1p5b \\
        --mapper /tmp/kvh/mappers/<id> --lengths 1024,2048,4096,8192 --export-memory device --out /tmp/real.json
    python scripts/bench_vllm_ttft.py --smoke --out /tmp/vllm_ttft.json          # CPU: the tiny pair, 64 / 128
    python scripts/bench_vllm_ttft.py --smoke --lengths 512,2048,8192 --repeats 5 --timings --out /tmp/t.json

Real pair (`--models SENDER RECEIVER --mapper DIR`): checked before any engine starts — both directories hold a
model, the mapper maps this sender into this receiver (tokenizer, fingerprints in the dtype it was fitted in) and
the connector's length guard (default policy) maps every length — each refusal a clear error. The engines run the
mapper's fitted dtypes (src/serving/config.py `fitted_dtypes`) and the default policy; on a GPU bf16, blocks of 16,
CUDA graphs; on the CPU float32, blocks of 32, eager. Histories are consecutive windows of real text (`--text`, a
corpus of src/corpus.py, by default Gutenberg part 2, which no calibration budget reads), so no two prompts share a
block; random weights get random tokens and a random Head-Local mapper of `--k` source layers per target layer (24,
the real capacity point's) with bf16 coefficients on a GPU (`--compute-dtype`), as the real pair's bf16 fit. Records
before 2026-12-07 used k = 2 and float32 coefficients: a twelfth of the map's work, and vLLM's workers run float32
matmuls at full precision (`VLLM_FLOAT32_MATMUL_PRECISION` "highest").

Per length and repeat, a fresh history of n tokens and a 16-token turn (prompts no engine has seen):
    re-prefill  the receiver reads history + turn, nothing cached                      (plain request)
    hit         the receiver read the history before; it computes the turn on its own blocks   (plain request)
    map         the sender reads the history and exports it; the receiver claims the mapped history and
                computes the turn: TTFT = the receiver's request + the export's cost on the sender
                (its request with the export minus the same request of another fresh history without)
A request's TTFT is the wall time of `LLM.generate` for one greedy token. Plain requests run on the receiver
engine itself (no kvrelay parameters: the connector declines them). Writes one JSON: every measurement, the
medians, the paired speedups with their intervals, the machine and the versions. `--timings` adds, per length, the
median host time of each phase of the handoff on both engines (src/serving/timings.py: host wall time, GPU work
queued not included), over the measured repeats.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from src.eval.intervals import median_interval  # noqa: E402

TURN = 16


def _timed(llm, prompt: list[int], params: dict | None = None, salt: str | None = None) -> tuple[float, dict]:
    """(ms, the connector's record) of one greedy token after `prompt` (a request with `salt` as its cache_salt)."""
    from vllm import SamplingParams

    from src.serving.params import prompt as request

    sampling = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False,
                              extra_args=None if params is None else {"kv_transfer_params": params})  # fmt: skip
    began = time.perf_counter()
    output = llm.generate([request(prompt, salt)], sampling, use_tqdm=False)[0]
    return (time.perf_counter() - began) * 1e3, (output.kv_transfer_params or {}).get("kvrelay", {})


def measure(
    small, large, mapper: str, lengths: list[int], repeats: int, fresh: Callable[[int], list[int]],
    timings: Path | None = None, keys: str = "cache_salt",
) -> list[dict]:  # fmt: skip
    """One row per length: every repeat's ms per path, and what the receiver mapped (module docstring); `fresh(n)`:
    n tokens no engine has seen (`random_tokens`, `text_tokens`); with `timings` (the engines' KVRELAY_TIMINGS
    file), the median host ms of each phase (`host_ms`; its role "device": the map's device ms on CUDA); `keys`: how
    the handoff's prefix-cache keys are kept apart — "cache_salt" (its provenance salt, as the router sends it) or
    "re-keyed" (none: the connector re-keys)."""
    from src.serving.provenance import provenance_salt

    rows = []
    for n in lengths:
        row = {"tokens": n, "reprefill_ms": [], "hit_ms": [], "map_ms": [], "export_ms": [], "mapped": []}
        offset = 0  # where the measured repeats' timing lines begin
        for repeat in range(repeats + 1):  # the first round warms each path up and is dropped
            if repeat == 1 and timings is not None and timings.exists():
                offset = timings.stat().st_size
            turn = fresh(TURN)
            reprefill, _ = _timed(large, fresh(n) + turn)
            held = fresh(n)
            _timed(large, held)
            hit, _ = _timed(large, held + turn)
            without, _ = _timed(small, fresh(n))
            history = fresh(n)  # new to both engines
            with_export, exported = _timed(small, history, {"kvrelay": {"export": True}})
            handoff = {"kvrelay": {"handoff": {"export": exported["export"], "mapper": mapper}}}
            salt = provenance_salt(exported["export"], mapper) if keys == "cache_salt" else None
            mapped, record = _timed(large, history + turn, handoff, salt)
            done = record.get("handoff", {})
            if (done.get("status"), done.get("keys")) != ("mapped", keys):
                raise RuntimeError(f"the handoff at {n} tokens was not mapped with keys {keys!r}: {record}")
            if repeat:
                row["reprefill_ms"].append(reprefill)
                row["hit_ms"].append(hit)
                row["export_ms"].append(with_export - without)
                row["map_ms"].append(mapped)
                row["mapped"].append(record["handoff"]["mapped"])
        if timings is not None:
            row["host_ms"] = phase_medians(timings, offset)
        routed = [m + max(e, 0.0) for m, e in zip(row["map_ms"], row["export_ms"], strict=True)]
        row["median_ms"] = {
            "reprefill": statistics.median(row["reprefill_ms"]),
            "hit": statistics.median(row["hit_ms"]),
            "map": statistics.median(row["map_ms"]),
            "routed": statistics.median(routed),
        }
        row["speedup"] = {  # re-prefill / path, paired per repeat: median [95 % order-statistic interval; None: < 6]
            path: [
                v if math.isfinite(v) else None
                for v in median_interval([r / x for r, x in zip(row["reprefill_ms"], ms, strict=True)])
            ]
            for path, ms in (("routed", routed), ("hit", row["hit_ms"]))
        }
        rows.append(row)
    return rows


def random_tokens(vocab: int, seed: int = 0) -> Callable[[int], list[int]]:
    """`fresh(n)`: n random token ids in 2..vocab−1."""
    rng = random.Random(seed)
    return lambda n: rng.choices(range(2, vocab), k=n)


def tokens_needed(lengths: list[int], repeats: int) -> int:
    """How many tokens `measure` draws: per length and round (the warm-up too) four histories and one turn."""
    return sum((repeats + 1) * (4 * n + TURN) for n in lengths)


def text_tokens(data: Path, corpus: str, tokenizer, count: int) -> Callable[[int], list[int]]:
    """`fresh(n)`: the next n tokens of the first `count` tokens of a real corpus (src/corpus.py), consecutive and
    never repeated; a ValueError when the corpus holds fewer."""
    from src.corpus import token_sequences

    stream = token_sequences(data, corpus, 1, count, tokenizer, len(tokenizer))[0].tolist()
    at = 0

    def fresh(n: int) -> list[int]:
        nonlocal at
        if at + n > len(stream):
            raise ValueError(f"the text histories ran out: {len(stream)} tokens of {corpus} drawn, {at + n} needed")
        at += n
        return stream[at - n : at]

    return fresh


def check_real(sender: Path, receiver: Path, mapper: Path, lengths: list[int], block: int) -> dict[str, str]:
    """The connector's dtype settings of `mapper` (`fitted_dtypes`) once, before any engine starts, both
    directories hold a model, the mapper maps `sender` into `receiver` (its tokenizer, then both fingerprints in the
    dtype it was fitted in) and the default policy's length guard maps a history of every length (the span it
    claims: whole blocks of `block`); else a ValueError that names what is wrong."""
    from src.artifact import ArtifactError, load_mapper
    from src.runtime.routing import length_refusal
    from src.serving.config import RouteSpec, fitted_dtypes, serving_policy
    from src.serving.routes import model_tokenizer_hash, scheduled_routes, viewed

    for role, path in (("sender", sender), ("receiver", receiver)):
        if not (path / "config.json").is_file():
            raise ValueError(f"--models: no {role} model at {path} (no config.json there)")
    try:
        manifest = load_mapper(mapper).manifest  # its bytes against its manifest
    except (ArtifactError, FileNotFoundError, OSError) as error:
        raise ValueError(f"--mapper {mapper}: not a mapper artifact ({error})") from None
    (route,) = scheduled_routes((RouteSpec(mapper, sender),), model_tokenizer_hash(receiver)).values()
    dtypes = fitted_dtypes(manifest)
    for role, path, key in (("sender", sender, "source_fingerprint"), ("receiver", receiver, "target_fingerprint")):
        _, identity = viewed(path, getattr(torch, dtypes["fingerprint_dtype"]))  # streamed: no model loads
        if identity.fingerprint != manifest.get(key):
            raise ValueError(f"--mapper {mapper} does not map {sender} → {receiver}: its {key} "
                             f"{str(manifest.get(key))[:12]} ≠ the {role} {path}'s {identity.fingerprint[:12]} "
                             f"(in {dtypes['fingerprint_dtype']}, the dtype it was fitted in)")  # fmt: skip
    policy = serving_policy({})
    for n in lengths:
        if why := length_refusal(policy, route.route, n, n // block * block):
            raise ValueError(f"--lengths: a {n}-token history would not be mapped: {why}")
    return dtypes


def phase_medians(path: Path, offset: int) -> dict:
    """{role: {phase: median ms}} over the requests whose timing lines follow byte `offset` of `path` (a request's
    lines of one phase summed first: a phase met twice counts once)."""
    total: dict[tuple[str, str, str], float] = collections.defaultdict(float)
    with path.open("rb") as stream:
        stream.seek(offset)
        for line in stream.read().decode().splitlines():
            entry = json.loads(line)
            total[entry["role"], entry["phase"], entry["request"]] += entry["ms"]
    phases: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for (role, phase, _), ms in total.items():
        phases[role, phase].append(ms)
    medians: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for (role, phase), ms in sorted(phases.items()):
        medians[role][phase] = round(statistics.median(ms), 4)
    return dict(medians)


def machine() -> dict:
    import vllm

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return {"device": device, "torch": torch.__version__, "vllm": vllm.__version__, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d")}  # fmt: skip


def build(pair: Path, work: Path, dtype: torch.dtype, k: int) -> tuple[Path, Path, Path]:
    """The pair's random-weight models (its conf/pair YAML: config + seed each) saved with the tests' tokenizer, and a
    random-coefficient Head-Local mapper of k source layers per target layer between them (src/synthetic.py): (small,
    large, mapper) directories. Until 2026-12-07 k was 2, whatever the pair (the real capacity point reads 24)."""
    from src.artifact import save_mapper
    from src.models import build_random_model, describe_kv, fingerprint, load_model, load_tokenizer, tokenizer_hash
    from src.synthetic import synthetic_mapper
    from tests.vllm_pair import tiny_tokenizer

    built = work / "mapper.k"  # the k of the mapper an earlier run into the same --work built
    if built.is_file() and built.read_text() == str(k) and (work / "mapper").is_dir():
        return work / "source", work / "target", work / "mapper"
    spec = yaml.safe_load(pair.read_text())
    models = {}
    for role in ("source", "target"):
        model = build_random_model(spec[role]["config"], spec[role]["seed"], dtype)
        model.save_pretrained(work / role)
        tiny_tokenizer().save_pretrained(work / role)
        models[role] = load_model(work / role, dtype=torch.float32)  # as the connector fingerprints it
    token_hash = tokenizer_hash(load_tokenizer(work / "target"))
    manifest = {"source_fingerprint": fingerprint(models["source"]), "target_fingerprint": fingerprint(models["target"]),
                "tokenizer_hash": token_hash, "token_features": False, "calibration": {}}  # fmt: skip
    source_kv, target_kv = describe_kv(models["source"]), describe_kv(models["target"])
    shutil.rmtree(work / "mapper", ignore_errors=True)  # another k's
    save_mapper(synthetic_mapper(source_kv, target_kv, "local", k, manifest, seed=0), work / "mapper")
    built.write_text(str(k))
    return work / "source", work / "target", work / "mapper"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", type=Path, default=ROOT / "conf/pair/qwen25coder_0p5b_to_1p5b_random.yaml")
    parser.add_argument("--models", type=Path, nargs=2, metavar=("SENDER", "RECEIVER"), default=None,
                        help="a real pair's model directories (with --mapper; instead of --pair)")  # fmt: skip
    parser.add_argument("--mapper", type=Path, default=None, help="the real pair's fitted mapper directory")
    parser.add_argument("--text", default="gutenberg_part2", help="--models: the corpus of the histories")
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data", help="--models: its root")
    parser.add_argument("--lengths", default=None, help="default 1024,...,16384 (--smoke: 64,128)")
    parser.add_argument("--repeats", type=int, default=None, help="default 11 (≥ 6: the speedups get a 95 %% "
                        "interval; --smoke: 1)")  # fmt: skip
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=None, help="where models, mapper and exports go (default: temp)")
    parser.add_argument("--smoke", action="store_true", help="CPU: the tests' tiny pair (at 64 and 128 tokens)")
    parser.add_argument("--timings", action="store_true",
                        help="the handoff's host time per phase (KVRELAY_TIMINGS), medians per length")  # fmt: skip
    parser.add_argument("--export-memory", choices=("host", "device"), default="host",
                        help="where the sender keeps its exports (src/serving/transport.py); device: CUDA only")  # fmt: skip
    parser.add_argument("--export-pool-mb", type=int, default=0,
                        help="the sender's device exports in one export pool of this many MiB (kv_connector_extra_"
                             "config export_pool_mb, src/serving/export_pool.py); 0: each its own allocations")  # fmt: skip
    parser.add_argument("--apply-backend", choices=("torch", "auto", "triton", "gemm"), default="torch",
                        help="the receiver's map kernel (kv_connector_extra_config apply_backend)")  # fmt: skip
    parser.add_argument("--paged-writer", choices=("backend", "stacked"), default="backend",
                        help="how the receiver writes mapped K/V (kv_connector_extra_config paged_writer)")  # fmt: skip
    parser.add_argument("--k", type=int, default=24,
                        help="random weights: the mapper's source layers per target layer (24: the real pair's "
                             "capacity point, every layer of the 0.5B; ≤ the source's layers)")  # fmt: skip
    parser.add_argument("--compute-dtype", choices=("float32", "bfloat16"), default=None,
                        help="random weights: the map's coefficients (kv_connector_extra_config compute_dtype; "
                             "default bfloat16 on a GPU as the real pair's bf16 fit, float32 on a CPU)")  # fmt: skip
    parser.add_argument("--keys", choices=("cache_salt", "re-keyed"), default="cache_salt",
                        help="the handoff carries its provenance salt (as the router sends it), or none: the "
                             "connector re-keys (src/serving/provenance.py)")  # fmt: skip
    args = parser.parse_args(argv)
    if (args.models is None) != (args.mapper is None) or (args.models and args.smoke):
        parser.error("--models and --mapper go together, without --smoke")
    if args.models and args.compute_dtype:
        parser.error("--compute-dtype: a real mapper's coefficients are in the dtype it was fitted in (its manifest)")
    if args.k < 1:
        parser.error(f"--k is ≥ 1, not {args.k}")
    if args.export_pool_mb < 0 or (args.export_pool_mb and args.export_memory != "device"):
        parser.error("--export-pool-mb is ≥ 0, and > 0 only with --export-memory device (a pool of device exports)")
    default = "64,128" if args.smoke else "1024,2048,4096,8192,16384"
    lengths = [int(n) for n in (args.lengths or default).split(",")]
    repeats = args.repeats or (1 if args.smoke else 11)
    gpu = torch.cuda.is_available()
    dtypes, coefficients, described = {}, {}, {}  # a real mapper's fitted dtypes (both engines); a random one's
    if args.models:  # every refusal before an engine starts
        try:
            dtypes = check_real(*args.models, args.mapper, lengths, 16 if gpu else 32)
        except ValueError as error:
            parser.error(str(error))
    import os

    from src.artifact import load_mapper
    from src.models import load_tokenizer
    from src.runtime.routing import mapper_id
    from tests.vllm_pair import ENV, engine, serving_pair

    os.environ.update(ENV)
    # The engines' processes are spawned, not forked: the models were just built here with torch's CPU threads, and a
    # fork after them hung the first engine's start on an H100 (2026-12-06). FlashInfer's sampler would be compiled
    # by JIT at the engine's warm-up (no AOT kernels travel with the wheels); a greedy token does not need it.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    work = args.work or Path(tempfile.mkdtemp(prefix="kvrelay-ttft-"))
    timings = None
    if args.timings:  # before the engines start: their processes read it
        timings = work / "timings.jsonl"
        timings.unlink(missing_ok=True)
        os.environ["KVRELAY_TIMINGS"] = str(timings)
    exports = {"transport": str(work / "exports")}
    memory = {"export_memory": args.export_memory, "export_pool_mb": args.export_pool_mb}
    sender = exports | memory | {"keep_exports": 4}  # device exports hold GPU memory (a pool: export_pool_mb)
    policy = {"policy": {"length_guard": "off"}}  # random weights: no evidence to guard with; timing only
    longest = max(lengths) + 2 * TURN
    gpu_settings = dict(dtype="bfloat16", max_model_len=longest, block_size=16, enforce_eager=False,
                        gpu_memory_utilization=0.35, kv_cache_memory_bytes=None)  # fmt: skip
    if args.models:
        (small_dir, large_dir), mapper_dir, policy = args.models, args.mapper, {}  # the default policy: guards on
        settings = gpu_settings if gpu else dict(max_model_len=longest, kv_cache_memory_bytes=512 << 20)
        fresh = text_tokens(args.data, args.text, load_tokenizer(large_dir), tokens_needed(lengths, repeats))
        label, weights, dtype = f"{small_dir} → {large_dir}", "real", settings.get("dtype", "float32")
    elif args.smoke:
        pair = serving_pair(work)
        small_dir, large_dir, mapper_dir, settings = pair.small, pair.large, pair.fitted, {}
        if longest > 512:  # the tiny pair's 1024 positions are a config value, not a RoPE limit
            settings = dict(max_model_len=longest, hf_overrides={"max_position_embeddings": longest})
        fresh, label, weights, dtype = random_tokens(300), "tests/vllm_pair.py (smoke)", "random", "float32"
    else:
        try:
            small_dir, large_dir, mapper_dir = build(args.pair, work, torch.bfloat16, args.k)
        except ValueError as error:  # k past the source's layers, named by src/synthetic.py
            parser.error(f"--k: {error}")
        settings = gpu_settings
        fresh, label, weights, dtype = random_tokens(300), str(args.pair), "random", "bfloat16"
        coefficients = {"compute_dtype": args.compute_dtype or ("bfloat16" if gpu else "float32")}  # the receiver's
        described = {"mapper": f"random Head-Local k = {args.k}"}  # the record says which mapper it timed
    route = {"routes": [{"mapper": str(mapper_dir), "source": str(small_dir)}], "apply_backend": args.apply_backend,
             "paged_writer": args.paged_writer} | coefficients  # fmt: skip
    small = engine(small_dir, sender | dtypes, **settings)  # the sender fingerprints in the fitted dtype
    large = engine(large_dir, exports | route | policy | dtypes, **settings)
    run = {"export_memory": args.export_memory, "export_pool_mb": args.export_pool_mb,
           "apply_backend": args.apply_backend, "paged_writer": args.paged_writer,
           "keys": args.keys, "dtype": dtype,
           "commit": commit(), "timings": args.timings,
           "histories": f"text: {args.text}" if args.models else "random tokens",
           **dtypes, **coefficients, **described}  # fmt: skip
    rows, mapper = [], mapper_id(load_mapper(mapper_dir))
    for n in lengths:  # the record rewritten after each length: a call cut by its time limit keeps what ran
        rows += measure(small, large, mapper, [n], repeats, fresh, timings=timings, keys=args.keys)
        write(rows, label, run | {"lengths_done": f"{len(rows)} of {len(lengths)}"}, args.out, weights)
    for row in rows:
        print(row["tokens"], {k: round(v, 2) for k, v in row["median_ms"].items()})
        for role, phases in row.get("host_ms", {}).items():
            print(f"  {role:9s}", {k: round(v, 3) for k, v in phases.items()})
    return 0


def commit() -> str | None:
    """The code's git commit (None where the tree travelled without its history, as to a lent GPU)."""
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None


def write(rows: list[dict], pair: str, run: dict, out: Path, weights: str = "random") -> dict:
    """The bench's JSON record at `out` (written whole, then renamed into place); returns it. `run`: the sender's
    export memory (and pool), the receiver's map kernel, the dtype, the commit, the histories."""
    result = {"bench": "vllm_ttft", "pair": pair, "weights": weights, "run": run, "machine": machine(), "turn": TURN,
              "rows": rows}  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    partial.write_text(json.dumps(result, indent=2))
    partial.replace(out)
    return result


if __name__ == "__main__":
    sys.exit(main())
