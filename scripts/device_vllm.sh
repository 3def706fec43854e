#!/usr/bin/env bash
# vllm 0.26.0 (it pins torch 2.11.0, the device image's) on the lent GPU, and the kvrelay connector on it. Nothing
# outside the device can be reached and a call carries ≤ 64 MiB, so the wheels travel in chunks (docs/serving.md § 6).
# Stages — here (H) or on the device (D), in this order:
#   D probe      one call: the image's `pip freeze` → $OUT/freeze.txt (copy it to .stage/vllm/freeze.txt here)
#   H plan       the vllm wheel's own Requires-Dist against that freeze → .stage/vllm/missing.txt
#   H download   those wheels (--no-deps, cp312 manylinux x86_64), the vllm wheel repacked without FA2 (Hopper runs
#                FA3; FA2 is 123.5 of its 288.7 MiB), tarred and split by ../shared/tools/split-for-device: prints
#                the chunk calls
#   D stage      one call per chunk: carry [".stage/vllm-wheels.tar.part-XX"], `bash scripts/device_vllm.sh stage`
#   D install    joins, checks the sha256 (.stage/vllm-wheels.tar.sha256 carried), installs --no-index --no-deps into
#                /tmp/site, imports vllm and the connector — then, in the same lease:
#   D test       the connector's parts (layouts: the FlashAttention writer against its reference, on the GPU)
#   D bench      scripts/bench_vllm_ttft.py, random weights of the 0.5B → 1.5B shapes, 1K–16K → $OUT/vllm_ttft.json
set -euo pipefail
stage=$1
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
STAGE=.stage/vllm
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
case $stage in
  probe)
    mkdir -p "$OUT" && python3 -m pip freeze > "$OUT/freeze.txt" && python3 --version && nvidia-smi -L
    wc -l "$OUT/freeze.txt" ;;
  plan)
    mkdir -p $STAGE && [ -s $STAGE/freeze.txt ] || { echo "copy the probe's freeze.txt to $STAGE/freeze.txt"; exit 1; }
    [ -f $STAGE/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl ] ||
      python3 -m pip download -q --no-deps -d $STAGE vllm==0.26.0
    python3 - "$STAGE" <<'EOF'
import re, sys, zipfile
from pathlib import Path
from packaging.markers import default_environment
from packaging.requirements import Requirement
stage = Path(sys.argv[1])
have = {re.split("[=@ ]", l)[0].lower().replace("_", "-"): l for l in (stage / "freeze.txt").read_text().split("\n") if l}
wheel = zipfile.ZipFile(next(stage.glob("vllm-0.26.0-*.whl")))
meta = wheel.read("vllm-0.26.0.dist-info/METADATA").decode()
env = default_environment() | {"python_version": "3.12", "python_full_version": "3.12.3", "platform_machine": "x86_64",
                               "platform_system": "Linux", "sys_platform": "linux", "extra": ""}
missing = []
for line in meta.splitlines():
    if line.startswith("Requires-Dist: "):
        req = Requirement(line.split(": ", 1)[1])
        if req.marker is None or req.marker.evaluate(env):
            name = req.name.lower().replace("_", "-")
            print(f"{name:40s} {have.get(name, 'MISSING')}")
            missing += [str(req).split(";")[0]] if name not in have else []
(stage / "missing.txt").write_text("\n".join(missing) + "\n")
print(len(missing), "missing →", stage / "missing.txt")
EOF
    ;;
  download)
    mkdir -p $STAGE/wheels
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d $STAGE/wheels -r $STAGE/missing.txt
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
    tar cf .stage/vllm-wheels.tar -C $STAGE wheels
    sha256sum .stage/vllm-wheels.tar | cut -d' ' -f1 > .stage/vllm-wheels.tar.sha256
    du -sh .stage/vllm-wheels.tar
    bash ../shared/tools/split-for-device .stage/vllm-wheels.tar 60 ;;
  stage)
    mkdir -p "$HOME/stage" && mv .stage/vllm-wheels.tar.part-* "$HOME/stage/" && ls "$HOME/stage" ;;
  install)
    cat "$HOME"/stage/vllm-wheels.tar.part-* > "$HOME/stage/vllm-wheels.tar"
    echo "$(cat .stage/vllm-wheels.tar.sha256)  $HOME/stage/vllm-wheels.tar" | sha256sum -c
    tar xf "$HOME/stage/vllm-wheels.tar" -C "$HOME/stage"
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$HOME"/stage/wheels/*.whl
    python3 -c "import torch, vllm, src.serving.vllm_connector; print(torch.__version__, vllm.__version__)" ;;
  test)
    python3 -m pytest -q -p no:cacheprovider tests/test_vllm_parts.py 2>&1 | tee "$OUT/vllm-tests.txt" | tail -8 ;;
  bench)
    python3 scripts/bench_vllm_ttft.py --out "$OUT/vllm_ttft.json" --work /tmp/vllm-bench 2>&1 |
      tee "$OUT/vllm-bench.txt" | grep -v -E "^\(|^INFO|^WARNING" | tail -12 ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
