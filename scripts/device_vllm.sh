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
#                on its GPU (MEMORY=device, the default) or in files (MEMORY=host) → $OUT/vllm_ttft_<memory>.json
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
  test)
    python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_vllm_parts.py tests/test_transport.py 2>&1 |
      tee "$OUT/vllm-tests.txt" | tail -8 ;;
  bench)
    memory=${MEMORY:-device}  # the sender's exports: on its GPU (CUDA IPC), or MEMORY=host (files)
    python3 scripts/bench_vllm_ttft.py --export-memory "$memory" --apply-backend auto --timings \
      --out "$OUT/vllm_ttft_$memory.json" \
      --work /tmp/vllm-bench 2>&1 | tee "$OUT/vllm-bench-$memory.txt" | grep -v -E "^\(|^INFO|^WARNING" | tail -12 ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
