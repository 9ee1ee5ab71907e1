#!/usr/bin/env bash
# Wheels the GPU machine lacks, for benchmarks/gpu_rollout.py (docs/gpu.md). Run here, where pip reaches the
# package registry; the device machine has no network. Writes DEST (default .whl, git-ignored):
#   DEST/*.whl         deepspeed (a pure wheel: DS_BUILD_OPS=0, its CUDA ops JIT-compile on the GPU), and the
#                      runtime dependencies of deepspeed and kubealign's ppo stage that the device image lacks,
#                      at the versions of requirements/lock-cpu.txt
#   DEST/legacy/*.whl  the side environment of path (d): transformers 4.44.2 with the tokenizers and
#                      huggingface-hub it needs (DeepSpeed's injected kernels stop working after 4.48)
#   DEST/ops/*.whl     deepspeed again, with fused_adam and transformer_inference prebuilt for sm_90 against
#                      torch 2.11.0 + CUDA 13.0 (benchmarks/gpu/ops.sh: minutes the first time, then cached);
#                      run.sh installs it over the pure one and goes back to the pure one if an op fails to load.
#                      NO_OPS=1 leaves it out.
# What the device image already has (torch 2.11, transformers 5.17, accelerate, safetensors, pyarrow,
# ninja, msgpack, py-cpuinfo, psutil, nvidia-ml-py, pyyaml, ...) is not carried: two versions of one
# package stop the install there. Python 3.12, x86-64, manylinux.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${1:-.whl}
LOCK=requirements/lock-cpu.txt
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

locked() {  # NAME -> NAME==VERSION as the lock pins it
    local line
    line=$(grep -i -m1 "^$1==" "$LOCK") || { echo "wheels.sh: $1 is not in $LOCK" >&2; exit 2; }
    echo "$line"
}

BINARY=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
        --platform manylinux1_x86_64 --platform any)
# deepspeed's own needs beyond the image (hjson, pydantic and its parts), and what kubealign imports on the
# ppo path (datasets for the prompt split, with dill and multiprocess; peft at the version the tests here
# pass with, in front of the image's own). mlflow, kfp, kubernetes and jsonschema are not needed: the
# benchmark and the gpu tests run with tracking off and never compile a pipeline.
# typing_extensions: pydantic_core needs >= 4.14 at import, and the image's own version is unknown.
CORE=(hjson pydantic pydantic_core annotated-types typing-inspection typing_extensions datasets dill multiprocess peft)
LEGACY=(transformers==4.44.2 tokenizers==0.19.1 huggingface-hub==0.24.7)

mkdir -p "$DEST/legacy" "$DEST/ops"
rm -f "$DEST"/*.whl "$DEST"/legacy/*.whl "$DEST"/ops/*.whl  # one version of each, from this run only
specs=()
for name in "${CORE[@]}"; do specs+=("$(locked "$name")"); done
"$PY" -m pip download -q "${BINARY[@]}" --abi none --abi abi3 -d "$DEST" "${specs[@]}"
# No build isolation: deepspeed's setup.py imports torch, which this venv has (an isolated build would
# fetch a second torch just to read its version).
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" "$(locked deepspeed)"
"$PY" -m pip download -q "${BINARY[@]}" --abi none --abi abi3 -d "$DEST/legacy" "${LEGACY[@]}"

[ "${NO_OPS:-0}" = 1 ] || bash benchmarks/gpu/ops.sh "$DEST/ops"

ls "$DEST"/*.whl "$DEST"/legacy/*.whl "$DEST"/ops/*.whl 2>/dev/null | sed "s|^$DEST/||"
du -sh "$DEST" | awk '{print "wheels.sh: " $1 " in total (a device call carries at most 64 MiB)"}'
