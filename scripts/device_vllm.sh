#!/usr/bin/env bash
# vllm 0.26.0 (it pins torch 2.11.0, the device image's) on the lent GPU, and the kvrelay connector on it. Nothing
# outside the device can be reached and a call carries ≤ 64 MiB, so the wheels travel in chunks (docs/serving.md § 6).
# Stages — here (H) or on the device (D), in this order, back to back in one lease (30 s idle gives it back):
#   H download   the wheels of scripts/vllm_gpu_wheels.txt (--no-deps, cp312 manylinux x86_64) and the vllm wheel
#                repacked without FA2 (imported under try/except; Hopper runs FA3), tarred and split to fit beside the
#                tracked tree by ../shared/tools/split-for-device: prints the chunk calls (5 or 6)
#   D stage      one call per chunk: carry [".stage/vllm-wheels.tar.part-XX"], `bash scripts/device_vllm.sh stage`
#   D install    joins, checks the sha256 (carry [".stage/vllm-wheels.tar.sha256"]), installs --no-index --no-deps into
#                /tmp/site, imports vllm and the connector
#   D test       the connector's parts and the transport; FlashAttention's own cache writer against kvrelay's layout
#                and a device export across two processes (the gpu mark)
#   D bench      scripts/bench_vllm_ttft.py, random weights of the 0.5B → 1.5B shapes, 1K–16K, the sender's exports
#                on its GPU (MEMORY=device, the default) or in files (MEMORY=host), the receiver's block writes per
#                layer (PAGED_WRITER=backend, the default) or stacked, the handoff salted (KEYS=cache_salt, the
#                default) or re-keyed, the sender's device exports in an export pool of POOL_MB MiB (default 0:
#                none), the map APPLY=auto (Triton on CUDA) or gemm, REPEATS measured rounds per length (21), LENGTHS
#                (1K–16K) → $OUT/vllm_ttft_<memory>_<writer>_<keys>[_pool<N>][_gemm].json
#   D real       the real pair (after scripts/device_quality.sh setup + models on this machine): PARTS (default
#                "fit parity ttft"; "down" for the reverse direction's fit + parity; without fit, MAPPER=<dir> names
#                the 0.5B → 1.5B mapper, e.g. one `scripts/find_mapper.py` printed) inside BUDGET_S (540): fit — the
#                capacity point's mapper at bf16 (CAPACITY of device_quality.sh), a tiny fit_eval job that fits it or
#                finds it in /tmp/kvh/mappers (a gate stage's fit is the same artifact); parity — scripts/vllm_parity.py
#                on PARITY_ITEMS (40) validation passages, bf16, blocks of 16, eager (PARITY_GRAPHS=1: CUDA graphs)
#                (PARITY_WRITER=stacked: the receiver's direct writer; the same items' record with the backend's writer
#                should agree bit for bit) → $OUT/vllm_parity_<up|down>.json; ttft — scripts/bench_vllm_ttft.py
#                --models/--mapper, real-text histories, REAL_LENGTHS (1K–8K: 8 × the 1,024-token calibration),
#                REAL_REPEATS (21), device exports in a pool of POOL_MB (1536), the receiver's direct writer
#                (PAGED_WRITER=stacked; backend: each layer's), the Triton map → $OUT/vllm_ttft_real.json (until
#                2026-12-07: 9 repeats, each layer's writer, no pool). One line of summary per part.
# scripts/vllm_gpu_wheels.txt: vllm 0.26.0's Requires-Dist less the device image's packages (KINDS.md's list of
# 2026-11-17), plus their own missing needs and three pins found on an H100 (2026-12-06): openai 2.29 (3.x imports
# httpx2), xgrammar 0.2.1 (0.2.9 needs a newer apache-tvm-ffi than vllm's pin), pydantic-extra-types (mistral_common).
# Left out, not needed to serve a decoder: torchcodec, PyNvVideoCodec, tilelang, nvidia-cutlass-dsl, quack-kernels,
# tokenspeed-mla, humming-kernels, fastsafetensors, mcp, anthropic, opentelemetry-*, model-hosting-container-standards.
set -euo pipefail
stage=$1
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
STAGE=.stage/vllm
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
case $stage in
  download)
    mkdir -p $STAGE/wheels
    [ -f $STAGE/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl ] ||
      python3 -m pip download -q --no-deps -d $STAGE vllm==0.26.0
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
      --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d $STAGE/wheels -r scripts/vllm_gpu_wheels.txt
    python3 - "$STAGE" <<'EOF'
import sys, zipfile
from pathlib import Path
stage = Path(sys.argv[1])
source = next(stage.glob("vllm-0.26.0-*.whl"))
drop = "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"  # imported under try/except; FA3 serves SM 9.x
with zipfile.ZipFile(source) as old, zipfile.ZipFile(stage / "wheels" / source.name, "w", zipfile.ZIP_DEFLATED) as new:
    for info in old.infolist():
        if info.filename == drop:
            continue
        data = old.read(info)
        if info.filename.endswith("dist-info/RECORD"):
            data = b"\n".join(l for l in data.split(b"\n") if not l.startswith(drop.encode()))
        new.writestr(info, data)
print("repacked without FA2:", round((stage / "wheels" / source.name).stat().st_size / 2**20, 1), "MiB")
EOF
    rm -f .stage/vllm-wheels.tar .stage/vllm-wheels.tar.part-*
    tar cf .stage/vllm-wheels.tar -C $STAGE wheels
    sha256sum .stage/vllm-wheels.tar | cut -d' ' -f1 > .stage/vllm-wheels.tar.sha256
    tree_mb=$(git ls-files -z | xargs -0 stat -c %s | awk '{k += int(($1 + 4095) / 4096)} END {print int(k / 256) + 1}')  # a call carries the tree and one chunk;
    # files in 4 KiB blocks: 45 MiB chunks beside 18.7 MiB of tracked bytes were refused (2026-12-06)
    du -sh .stage/vllm-wheels.tar
    bash ../shared/tools/split-for-device .stage/vllm-wheels.tar $((64 - tree_mb - 2)) ;;
  stage)
    mkdir -p "$HOME/stage" && mv .stage/vllm-wheels.tar.part-* "$HOME/stage/" && ls "$HOME/stage" ;;
  install)
    cat "$HOME"/stage/vllm-wheels.tar.part-* > "$HOME/stage/vllm-wheels.tar"
    echo "$(cat .stage/vllm-wheels.tar.sha256)  $HOME/stage/vllm-wheels.tar" | sha256sum -c
    tar xf "$HOME/stage/vllm-wheels.tar" -C "$HOME/stage"
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$HOME"/stage/wheels/*.whl
    python3 -c "import torch, vllm, src.serving.vllm_connector; print(torch.__version__, vllm.__version__)" ;;
  test)  # the comparison with FlashAttention's own writer hung on an H100 three times: vLLM 0.26's writer never
    # finishes on one 16-channel head in strided views (results/vllm-h100-2026-12-06f/fa-probe.txt); with both heads
    # it passed (results/vllm-h100-2026-12-07/). Still run last and alone, cut at 150 s with every thread's stack
    # dumped at 60 s (faulthandler): every other test first — a failure there does not stop the stage
    fa=tests/test_paged_direct.py::test_the_direct_map_is_what_vllms_flash_cache_writer_writes_of_the_mapped_scratch
    python3 -m pytest -v -p no:cacheprovider -m "gpu or not gpu" --deselect "$fa" tests/test_paged_direct.py \
      tests/test_paged_read.py tests/test_transport.py tests/test_vllm_parts.py 2>&1 | tee "$OUT/vllm-tests.txt" \
      | grep -E -v "PASSED|SKIPPED" | tail -8 || echo "some tests failed: $OUT/vllm-tests.txt"
    timeout 150 python3 -X faulthandler -m pytest -v -p no:cacheprovider -m gpu -o faulthandler_timeout=60 "$fa" 2>&1 \
      | tee "$OUT/vllm-tests-flash-writer.txt" | tail -8 || echo "the flash-writer comparison: cut at 150 s" ;;
  bench)  # both engines start in ≈ 90 s each on a fresh machine (compile, graphs): ≥ 360 s for three lengths; the
    # record is rewritten after each length, so a cut call keeps the lengths that ran
    memory=${MEMORY:-device}  # the sender's exports: on its GPU (CUDA IPC), or MEMORY=host (files)
    writer=${PAGED_WRITER:-backend}  # the receiver's block writes: per layer (backend) or PAGED_WRITER=stacked
    keys=${KEYS:-cache_salt}  # the handoff's provenance salt (the router's), or KEYS=re-keyed (the connector re-keys)
    pool=${POOL_MB:-0}  # MiB of the sender's export pool (export_pool_mb); 0: each export its own allocations
    repeats=${REPEATS:-21}  # 11 gave routed / hit intervals of ± 0.2–0.3 at 8K (2026-12-06, ninth session): too wide to
    # decide a 1.3× target; each repeat costs ≈ 0.3 s at 16K, the engines' start dominates
    apply=${APPLY:-auto}  # the receiver's map: auto (Triton on CUDA) or APPLY=gemm (kernels/apply_map_gemm.py)
    suffix=""
    if [ "$pool" -gt 0 ]; then suffix=_pool$pool; fi
    if [ "$apply" != auto ]; then suffix=${suffix}_$apply; fi
    python3 scripts/bench_vllm_ttft.py --export-memory "$memory" --export-pool-mb "$pool" --apply-backend "$apply" \
      --repeats "$repeats" --timings --paged-writer "$writer" --keys "$keys" ${LENGTHS:+--lengths "$LENGTHS"} \
      --out "$OUT/vllm_ttft_${memory}_${writer}_$keys$suffix.json" --work /tmp/vllm-bench 2>&1 \
      | tee "$OUT/vllm-bench-$memory-$writer-$keys${suffix/_/-}.txt" | grep -v -E "^\(|^INFO|^WARNING" | tail -12 ;;
  real)
    export KVRELAY_HOME=/tmp/kvh
    deadline=$((SECONDS + ${BUDGET_S:-540}))
    models=$KVRELAY_HOME/models
    eval "$(grep '^CAPACITY=' scripts/device_quality.sh)"  # the capacity point, one definition
    left() { echo $((deadline - SECONDS)); }
    fit() {  # fit PAIR: the capacity point's bf16 mapper of PAIR fitted (or found cached) → its directory on stdout
      local began=$SECONDS
      timeout "$(left)" python3 -m src.run pair="$1" pair.device=cuda pair.dtype=bfloat16 pair.compute_dtype=bfloat16 \
        pair.apply_backend=auto "${CAPACITY[@]}" "paths.data=$HOME/data" tracking.backend=json \
        "tracking.json_dir=$OUT/trk-fit-$1" eval.nll.streams=1 eval.latency.repeats=1 eval.latency.warmup=1 \
        eval.rollback=false > "$OUT/fit-$1.txt" 2>&1 || { echo "fit $1 FAILED: $OUT/fit-$1.txt" >&2; return 1; }
      python3 scripts/find_mapper.py "$OUT/trk-fit-$1" "$KVRELAY_HOME/mappers"
      # one file: $OUT returns ≤ 8 files, two folders deep (the record's artifacts sit three down)
      tar czf "$OUT/trk-fit-$1.tgz" -C "$OUT" "trk-fit-$1" && rm -rf "${OUT:?}/trk-fit-$1"
      echo "fit $1: $((SECONDS - began)) s" >&2
    }
    parity() {  # parity MAPPER NAME — its scratch (a K/V file per item) outside $OUT: 80 files there were over a call's
      # count and took the record with them (2026-12-06, seventh session); PARITY_WRITER=stacked: the direct writer
      timeout "$(left)" python3 scripts/vllm_parity.py --mapper "$1" --items "${PARITY_ITEMS:-40}" --device cuda \
        --dtype bfloat16 --block 16 --apply-backend auto ${PARITY_GRAPHS:+--cuda-graphs} --data "$HOME/data" \
        --paged-writer "${PARITY_WRITER:-backend}" --scratch "/tmp/parity-$2" \
        --out "$OUT/vllm_parity_$2.json" > "$OUT/vllm-parity-$2.txt" 2>&1 || echo "parity $2 FAILED (rc $?)"
      python3 -c "import json, sys; r = json.load(open(sys.argv[1])); v, a = r['verdict'], r['aggregate']
print('parity', sys.argv[2], r['mapper_id'], a['items'], 'items: floor', f\"{v['floor']:.2e}\", 'adds_difference',
      v['adds_difference'], 'greedy agree', a['mapped']['greedy_agree'][:2])" "$OUT/vllm_parity_$2.json" "$2" || true
    }
    up=${MAPPER:-}  # the 0.5B → 1.5B mapper directory: from `fit`, or MAPPER=<dir> when PARTS leaves fit out
    for part in ${PARTS:-fit parity ttft}; do
      [ "$(left)" -ge 60 ] || { echo "SKIPPED (out of time): $part"; continue; }
      case $part in
        parity | ttft) [ -n "$up" ] || { echo "$part: no mapper (PARTS without fit needs MAPPER=<dir>)"; continue; } ;;
      esac
      case $part in
        fit) up=$(fit qwen25coder_0p5b_to_1p5b) && echo "mapper up: $up" ;;
        parity) parity "$up" "up${PARITY_WRITER:+-$PARITY_WRITER}" ;;
        ttft)
          timeout "$(left)" python3 scripts/bench_vllm_ttft.py --models "$models/qwen25coder_0p5b" \
            "$models/qwen25coder_1p5b" --mapper "$up" --lengths "${REAL_LENGTHS:-1024,2048,4096,8192}" \
            --repeats "${REAL_REPEATS:-21}" --export-memory device --export-pool-mb "${POOL_MB:-1536}" \
            --paged-writer "${PAGED_WRITER:-stacked}" --apply-backend auto --timings --data "$HOME/data" \
            --work /tmp/vllm-real --out "$OUT/vllm_ttft_real.json" > "$OUT/vllm-bench-real.txt" 2>&1 ||
            echo "ttft FAILED (rc $?)"
          python3 -c "import json, sys
for row in json.load(open(sys.argv[1]))['rows']: print('ttft real', row['tokens'], 'routed speedup', row['speedup']['routed'], 'p50 ms', {k: round(v, 1) for k, v in row['median_ms'].items()})" "$OUT/vllm_ttft_real.json" || tail -5 "$OUT/vllm-bench-real.txt" ;;
        down) down=$(fit qwen25coder_1p5b_to_0p5b) && echo "mapper down: $down" && parity "$down" down ;;
        *) echo "unknown part $part"; exit 2 ;;
      esac
    done ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
