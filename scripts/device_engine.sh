#!/usr/bin/env bash
# The serving-grade receiver on the lent H200, random weights (timing only, never quality), one stage per call:
#   bash scripts/device_engine.sh setup    wheels (.whl: hydra-core, omegaconf, antlr4) + data (.stage/data) carried
#   bash scripts/device_engine.sh tests    the GPU tests of the engine and the turn-attention kernel
#   bash scripts/device_engine.sh sdpa     scripts/sdpa_first_call.py: does an attention backend pay per new length
#                                          (the gate baseline's ≈ 40 ms; BENCHMARKS § the timing harness)
#   bash scripts/device_engine.sh probe    ../shared/tools/engine_probe.py (carried as .stage/engine_probe.py) beside
#   bash scripts/device_engine.sh pair     +experiment=handoff, Qwen2.5-Coder 0.5B → 1.5B shapes, 1K–16K, three engines,
#                                          fused recompute by deviation and by the turn rule; 7 re-prefill repeats (a
#                                          speedup's 95 % interval needs ≥ 7 a side: intervals.median_ratio_interval)
#   bash scripts/device_engine.sh large    +experiment=handoff, Qwen3 14B → 32B shapes, 4K / 16K / 32K, graph engine
#                                          (LARGE_LENGTHS="[4096,16384]": fewer, for a short lease)
# APPLY=gemm: the map as one GEMM per target head (kernels/apply_map_gemm.py) instead of auto (Triton on CUDA).
# Records are JSON (tracking.backend=json) packed into $OUT/trk-<stage>.tgz; here: `python -m src.tracking import DIR`.
set -euo pipefail
stage=$1
export KVRELAY_HOME=/tmp/kvh PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}
COMMON=(+experiment=handoff budget=synthetic_paper "pair.apply_backend=${APPLY:-auto}" "paths.data=$HOME/data"
  tracking.backend=json "tracking.json_dir=$OUT/trk" eval.handoff.new_turn=32)
pack() { if [ -d "$OUT/trk" ]; then tar czf "$OUT/trk-$stage.tgz" -C "$OUT" trk && rm -rf "$OUT/trk"; fi; }
trap pack EXIT
case $stage in
  setup)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    mkdir -p "$HOME/data" && cp -r .stage/data/. "$HOME/data/"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python3 -c "import torch, transformers, triton, hydra; print(torch.__version__, transformers.__version__, triton.__version__)" ;;
  tests)
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_engine.py tests/test_kernels_attention.py \
      tests/test_kernels_engine.py 2>&1 |
      tee "$OUT/gpu-tests.txt" | tail -15 ;;
  sdpa)
    python3 scripts/sdpa_first_call.py 2>&1 | tee "$OUT/sdpa-first-call.txt" ;;
  probe)
    OUT=$OUT python3 .stage/engine_probe.py | tee "$OUT/probe.txt" ;;
  pair)
    python3 -m src.run "${COMMON[@]}" pair=qwen25coder_0p5b_to_1p5b_random fit.k=24 eval.handoff.prefill_repeats=7 \
      "eval.handoff.prefix_lens=[1024,2048,4096,8192,16384]" "eval.handoff.recompute_rules=[deviation,turn]" \
      eval.handoff.profile=true 2>&1 | tee "$OUT/pair.txt" | grep -v "^prefix" || true
    grep "^prefix" "$OUT/pair.txt" | cut -c1-400 ;;
  large)
    python3 -m src.run "${COMMON[@]}" pair=qwen3_14b_to_32b fit.k=8 "eval.handoff.engines=[graph]" \
      "eval.handoff.recompute_shares=[]" eval.handoff.warmup=1 "eval.handoff.prefix_lens=${LARGE_LENGTHS:-[4096,16384,32768]}" \
      eval.handoff.repeats=10 eval.handoff.prefill_repeats=2 2>&1 | tee "$OUT/large.txt" | grep -v "^prefix" || true
    grep "^prefix" "$OUT/large.txt" | cut -c1-400 ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
