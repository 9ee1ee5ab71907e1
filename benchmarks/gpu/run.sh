#!/usr/bin/env bash
# On the GPU machine, in the repository root (docs/gpu.md): install the wheels benchmarks/gpu/wheels.sh
# carried in, then run one step. Each step fits one device call (10 minutes): its --deadline-s skips the
# cases that would not finish, and the results file is rewritten after every case.
#   bash benchmarks/gpu/run.sh generation|correctness|iteration|all [gpu_rollout.py options]
#   bash benchmarks/gpu/run.sh tests      # item 4: pytest -m gpu
# Environment: WHL (default .whl), OUT (results dir; default benchmarks/results), SITE and LEGACY_SITE
# (where the wheels go; reused while the machine stays warm), DEADLINE_S (default 540).
set -euo pipefail
cd "$(dirname "$0")/../.."
step=${1:?usage: run.sh generation|correctness|iteration|all|tests [options]}
shift
WHL=${WHL:-.whl}
OUT=${OUT:-benchmarks/results}
TMP=${TMPDIR:-/tmp}
SITE=${SITE:-$TMP/kubealign-site}
LEGACY_SITE=${LEGACY_SITE:-$TMP/kubealign-legacy}
WORK=${WORK:-$TMP/kubealign-gpu-work}

install() {  # WHEEL_DIR TARGET: once per machine
    [ -f "$2/.installed" ] && return
    ls "$1"/*.whl >/dev/null 2>&1 || { echo "run.sh: no wheels in $1: run benchmarks/gpu/wheels.sh here first" >&2; exit 2; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$2" "$1"/*.whl
    touch "$2/.installed"
}
install "$WHL" "$SITE"
install "$WHL/legacy" "$LEGACY_SITE"
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# DeepSpeed JIT-compiles its CUDA ops once per machine; keep them out of the home directory.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$TMP/kubealign-torch-extensions}
# A carried wheel that does not fit the image's packages fails here, in seconds, not in a measurement.
python3 -c "import deepspeed, datasets, pydantic, kubealign.stages.ppo" 2>&1 | grep -v WARNING || true
python3 -c "import deepspeed, datasets, pydantic, kubealign.stages.ppo" >/dev/null 2>&1 \
    || { echo "run.sh: the carried wheels do not import beside this image's packages (above)" >&2; exit 2; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

if [ "$step" = tests ]; then
    mkdir -p "$OUT"
    exec python3 -m pytest -m gpu -p no:cacheprovider -q tests/test_gpu_ppo.py "$@" --junitxml "$OUT/gpu-tests.xml"
fi
exec python3 benchmarks/gpu_rollout.py "$step" --out "$OUT" --work "$WORK" --legacy-site "$LEGACY_SITE" \
    --deadline-s "${DEADLINE_S:-540}" "$@"
