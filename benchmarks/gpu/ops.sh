#!/usr/bin/env bash
# DeepSpeed 0.19.8's fused_adam and transformer_inference CUDA ops, compiled HERE (no GPU needed) for the
# GPU machine's H100/H200 (sm_90), so that no device minute goes to a JIT build (docs/gpu.md). Called by
# wheels.sh; runs alone too:  bash benchmarks/gpu/ops.sh [DEST]   (default DEST .whl/ops)
#
# The GPU image has torch 2.11.0+cu130 under Python 3.12. DeepSpeed accepts a prebuilt op only when the
# torch major.minor and CUDA major.minor it was built with equal the ones it runs with
# (op_builder/builder.py: validate_torch_version, validate_torch_op_version), so the build uses exactly
# those: torch 2.11.0 (PyPI's cp312 wheel: CUDA 13.0, its headers and libraries to link with) and the CUDA
# 13.0 compiler and headers from PyPI's wheels (cuda-toolkit 13.0.2, the set torch 2.11.0 itself requires).
# Output: DEST/deepspeed-0.19.8-cp312-cp312-linux_x86_64.whl, a wheel whose git_version_info_installed
# lists the two ops as installed (accelerator cuda), so op_builder's load() imports them instead of
# compiling. run.sh installs it over the pure wheel and keeps the pure one if an op fails to load.
#
# About 2 minutes of compiling on 2 cores (plus the venv: torch 2.11 and the CUDA wheels, about 5 GB); no GPU needed.
# Environment: PY312 (a Python 3.12; default python3.12), OPS_BUILD (venv, CUDA tree and log; default
# $TMPDIR/kubealign-ops-build, reused), MAX_JOBS (default 2), TORCH_CUDA_ARCH_LIST (default 9.0).
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${1:-.whl/ops}
PY312=${PY312:-python3.12}
BUILD=${OPS_BUILD:-${TMPDIR:-/tmp}/kubealign-ops-build}
TORCH=torch==2.11.0
CUDA=cuda-toolkit[nvcc,cccl,crt,nvvm,cudart,cublas,curand,profiler]==13.0.2
DEEPSPEED=$(grep -m1 '^deepspeed==' requirements/lock-cpu.txt)
mkdir -p "$BUILD" "$DEST"
VENV=$BUILD/venv
# cuobjdump (to check the arch of what was built) is on PyPI from 13.2 on only; it reads 13.0's cubins.
PACKAGES=("$TORCH" "$CUDA" nvidia-cuda-cuobjdump==13.2.78 ninja packaging psutil py-cpuinfo hjson pydantic numpy
          msgpack einops nvidia-ml-py wheel 'setuptools<82')
ARCH=${TORCH_CUDA_ARCH_LIST:-9.0}
KEY="${PACKAGES[*]} $DEEPSPEED arch $ARCH"
if [ "$(cat "$VENV/.installed" 2>/dev/null)" != "${PACKAGES[*]}" ]; then
    "$PY312" -m venv "$VENV"
    "$VENV/bin/pip" install -q --disable-pip-version-check "${PACKAGES[@]}"
    echo "${PACKAGES[*]}" >"$VENV/.installed"
fi
# A CUDA_HOME as torch's cpp_extension expects it, made of the wheels' files: bin/nvcc, include, nvvm, and
# lib64 with the unversioned names the linker looks for (-lcudart, -lcurand, -lcublas).
CU=$("$VENV/bin/python" -c "import nvidia, os; print(os.path.join(nvidia.__path__[0], 'cu13'))")
CUDA_HOME=$BUILD/cuda
rm -rf "$CUDA_HOME" && mkdir -p "$CUDA_HOME/lib64"
for part in bin include nvvm; do ln -s "$CU/$part" "$CUDA_HOME/$part"; done
for lib in "$CU"/lib/*.so*; do
    name=$(basename "$lib")
    ln -s "$lib" "$CUDA_HOME/lib64/$name"
    ln -sf "$lib" "$CUDA_HOME/lib64/${name%%.so*}.so"
done
ln -s "$CU/lib/libcudadevrt.a" "$CUDA_HOME/lib64/libcudadevrt.a"
ln -s "$CU/lib/libcudart_static.a" "$CUDA_HOME/lib64/libcudart_static.a"
export CUDA_HOME PATH="$CUDA_HOME/bin:$PATH"
"$CUDA_HOME/bin/nvcc" --version | tail -2

# The wheel is kept in $BUILD/dist with the key it was built for: built again only when the key changes.
if [ "$(cat "$BUILD/dist/.key" 2>/dev/null)" != "$KEY" ] || ! ls "$BUILD"/dist/deepspeed-*.whl >/dev/null 2>&1; then
    rm -rf "$BUILD/src" "$BUILD/dist" && mkdir -p "$BUILD/src" "$BUILD/dist"
    "$VENV/bin/pip" download -q --disable-pip-version-check --no-deps --no-binary :all: -d "$BUILD/src" "$DEEPSPEED"
    tar -xzf "$BUILD"/src/deepspeed-*.tar.gz -C "$BUILD/src"
    started=$(date +%s)
    echo "ops.sh: compiling (log: $BUILD/ops-build.log)"
    # DS_ACCELERATOR=cuda: this machine has no GPU, and the wheel must record the cuda accelerator (load()
    # ignores installed ops built for another one). DS_ENABLE_NINJA: parallel compiles (MAX_JOBS).
    (cd "$BUILD"/src/deepspeed-*/ && DS_ACCELERATOR=cuda DS_BUILD_OPS=0 DS_BUILD_FUSED_ADAM=1 \
        DS_BUILD_TRANSFORMER_INFERENCE=1 DS_ENABLE_NINJA=1 MAX_JOBS=${MAX_JOBS:-2} TORCH_CUDA_ARCH_LIST=$ARCH \
        "$VENV/bin/python" setup.py bdist_wheel -d "$BUILD/dist") >"$BUILD/ops-build.log" 2>&1 \
        || { tail -40 "$BUILD/ops-build.log" >&2; echo "ops.sh: the build failed (log: $BUILD/ops-build.log)" >&2; exit 1; }
    echo "$KEY" >"$BUILD/dist/.key"
    echo "ops.sh: compiled in $(($(date +%s) - started)) s"
    grep -E '^Install Ops=' "$BUILD/ops-build.log"
fi
rm -f "$DEST"/deepspeed-*.whl
cp "$BUILD"/dist/deepspeed-*.whl "$DEST/"
wheel=$(ls "$DEST"/deepspeed-*.whl)
# The two ops are in the wheel, built for sm_90 (the ELF inside each fat binary names its arch).
files=$(unzip -Z1 "$wheel")
for op in deepspeed/ops/adam/fused_adam_op deepspeed/ops/transformer/inference/transformer_inference_op; do
    grep -q "^$op\..*\.so$" <<<"$files" || { echo "ops.sh: $op missing from $wheel" >&2; exit 1; }
done
rm -rf "$BUILD/check" && unzip -q "$wheel" 'deepspeed/ops/*.so' -d "$BUILD/check"
for so in $(find "$BUILD/check" -name '*.so'); do
    elves=$("$CUDA_HOME/bin/cuobjdump" --list-elf "$so")
    for arch in ${ARCH//;/ }; do
        grep -q "sm_${arch//./}" <<<"$elves" || { echo "ops.sh: no sm_${arch//./} code in $so" >&2; exit 1; }
    done
    echo "ops.sh: $(basename "$so"): $(grep -c cubin <<<"$elves") cubin(s) for sm_${ARCH//./}, $(du -h "$so" | cut -f1)"
done
unzip -p "$wheel" deepspeed/git_version_info_installed.py | grep -E 'installed_ops|accelerator|torch_info'
du -h "$wheel"
