#!/usr/bin/env bash
# On the GPU machine, in the repository root (docs/gpu.md): install the wheels benchmarks/gpu/wheels.sh
# carried in, then run one step of benchmarks/gpu_rollout.py. A step plans its cases cheapest first within
# the call's deadline (benchmarks/gpu_plan.py): a case that would not fit is skipped, one that runs is
# killed at its timeout, and the results file is rewritten after every case.
#   bash benchmarks/gpu/run.sh generation|correctness|iteration|all [gpu_rollout.py options]
#   bash benchmarks/gpu/run.sh tests      # item 4: pytest -m gpu
#   bash benchmarks/gpu/run.sh padding-free   # real_lengths.py --quick at OPT-1.3B shape, bf16 (issue 62)
# Environment: WHL (default .whl), OUT (results and logs; default benchmarks/results), SITE and LEGACY_SITE
# (where the wheels go; reused while the machine stays warm), DEADLINE_S (default 540, counted from this
# script's start: a device call is cut at 600 s).
# Everything it prints also goes to OUT/gpu-run-STEP-TIME.log: a device call returns only the last 12,000
# characters of its output, the log comes back whole with the results.
set -euo pipefail
cd "$(dirname "$0")/../.."
step=${1:?usage: run.sh generation|correctness|iteration|all|tests|padding-free [options]}
shift
WHL=${WHL:-.whl}
OUT=${OUT:-benchmarks/results}
TMP=${TMPDIR:-/tmp}
SITE=${SITE:-$TMP/kubealign-site}
LEGACY_SITE=${LEGACY_SITE:-$TMP/kubealign-legacy}
WORK=${WORK:-$TMP/kubealign-gpu-work}
PKG=${PKG:-$TMP/kubealign-pkg}
DEADLINE_S=${DEADLINE_S:-540}
# padding-free: the HH-RLHF file, carried (docs/gpu.md: the device call sends the checkout, not ../shared)
HH=${HH:-.gpu-data/harmless-base-test.jsonl.gz}
ls "$WHL"/*.whl >/dev/null 2>&1 || { echo "run.sh: no wheels in $WHL: run benchmarks/gpu/wheels.sh here first" >&2; exit 2; }
mkdir -p "$OUT"
LOG="$OUT/gpu-run-$step-$(date -u +%Y%m%dT%H%M%S).log"

install() {  # WHEEL... -> TARGET (the last argument)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "${@: -1}" "${@:1:$#-1}"
}

setup() {  # once per machine: the wheels, then DeepSpeed's prebuilt ops if they load here
    [ -f "$SITE/.installed" ] && return
    install "$WHL"/*.whl "$SITE"
    install "$WHL"/legacy/*.whl "$LEGACY_SITE"
    if ls "$WHL"/ops/deepspeed-*.whl >/dev/null 2>&1; then
        install "$WHL"/ops/deepspeed-*.whl "$SITE"
        local rc=0
        python3 benchmarks/gpu/ops_check.py 2>&1 | grep -v WARNING || rc=${PIPESTATUS[0]}
        if [ "$rc" = 1 ]; then
            echo "run.sh: a prebuilt DeepSpeed op does not load here (above): the pure wheel instead, ops JIT-compile"
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --force-reinstall \
                --target "$SITE" "$WHL"/deepspeed-*.whl
        fi
    fi
    touch "$SITE/.installed"
}

package() {  # kubealign as pyproject.toml installs it, made of links into this checkout
    # The checkout is not installed there (no network, no build backend of the lock's version): on PYTHONPATH
    # alone, kubealign.configs, .components and .pipelines (top-level folders that pyproject.toml's
    # package-dir maps under kubealign) would not exist, and every preset lookup fails (the first GPU run of
    # `tests` did). Links, not copies: the tests and the harness read the files of this checkout.
    rm -rf "$PKG" && mkdir -p "$PKG/kubealign"
    local entry
    for entry in "$PWD"/kubealign/*; do ln -s "$entry" "$PKG/kubealign/"; done
    for entry in configs components pipelines; do ln -s "$PWD/$entry" "$PKG/kubealign/$entry"; done
}

main() {
    echo "run.sh $step $*: $(date -u +%FT%TZ), log $LOG"
    package
    export PYTHONPATH="$PKG:$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    # DeepSpeed JIT-compiles an op that is not prebuilt once per machine; keep it out of the home directory.
    export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$TMP/kubealign-torch-extensions}
    setup
    # A carried wheel that does not fit the image's packages fails here, in seconds, not in a measurement.
    local found
    if ! found=$(python3 -c "import typing_extensions, pydantic, deepspeed, datasets, kubealign.stages.ppo" 2>&1); then
        grep -v WARNING <<<"$found" >&2
        echo "run.sh: the carried wheels do not import beside this image's packages (above)" >&2
        return 2
    fi
    python3 -c "import deepspeed.git_version_info as v; print('deepspeed', v.version, 'prebuilt ops:',
        sorted(k for k, on in v.installed_ops.items() if on) or 'none (JIT)')" 2>&1 | grep -v WARNING || true
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    local left=$((DEADLINE_S - SECONDS))
    echo "run.sh: setup took ${SECONDS} s; ${left} s left for the step"
    if [ "$step" = tests ]; then
        # -P and --import-mode=append: python -m and pytest would otherwise put the checkout first on sys.path,
        # in front of $PKG (the checkout stays on PYTHONPATH, after it, for `tests`)
        timeout -k 10 "$left" python3 -P -m pytest -m gpu -p no:cacheprovider --import-mode=append -q \
            tests/stages/test_gpu_ppo.py "$@" \
            --junitxml "$OUT/gpu-tests.xml"
        return
    fi
    if [ "$step" = padding-free ]; then
        [ -f "$HH" ] || { echo "run.sh: no HH-RLHF file at $HH (docs/gpu.md: copy it into .gpu-data/)" >&2; return 2; }
        local label status=0
        label="opt-1.3b-quick-$(python3 -c 'import torch; print(torch.cuda.get_device_name(0).lower().replace(" ", "-"))' 2>/dev/null || echo cpu)"
        timeout -k 10 "$left" python3 benchmarks/real_lengths.py --quick --shape opt-1.3b --hh "$HH" \
            --label "$label" "$@" || status=$?
        [ "$(realpath "$OUT")" = "$(realpath benchmarks/results)" ] || cp benchmarks/results/real-lengths-opt-1.3b-*.json "$OUT"/ 2>/dev/null || true
        return "$status"
    fi
    python3 benchmarks/gpu_rollout.py "$step" --out "$OUT" --work "$WORK" --legacy-site "$LEGACY_SITE" \
        --deadline-s "$left" "$@"
}

main "$@" 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
