#!/bin/sh
# The install steps of both images (images/cpu and images/train), run inside `docker build`, from the
# build context that `kubealign images build` (make images) stages: deps/ (a wheelhouse of every locked
# runtime dependency, made on the host from requirements/lock-cpu.txt), deps/requirements.txt (their
# names and versions), own/ (kubealign's wheel). Everything installs with --no-index: the build never
# reaches a network, so it works behind a proxy with its own certificate authority and on an air-gapped
# build host. Two steps, so that a change to kubealign rebuilds one small layer, not the dependencies':
#
#   install.sh deps cpu    a venv at /opt/kubealign with the dependencies, CPU torch (the lock's X+cpu)
#   install.sh deps train  the same over the base image's CUDA torch (--system-site-packages), with
#                          DeepSpeed compiled here from its sdist, ops chosen by the DS_BUILD_* variables
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
    # The base image's torch is the CUDA build: it stays, and no CPU torch is installed over it.
    python3 -m venv --system-site-packages "$venv"
    grep -v -E '^(torch|deepspeed)==' "$context/deps/requirements.txt" > /tmp/requirements.txt
    deepspeed="$(grep -E '^deepspeed==' "$context/deps/requirements.txt")"
    $pip wheel --no-index --find-links "$context/deps" --no-binary deepspeed --no-deps --no-build-isolation \
      --wheel-dir /tmp/ds "$deepspeed"
    $pip install --no-index --find-links "$context/deps" -r /tmp/requirements.txt /tmp/ds/deepspeed-*.whl
    rm -rf /tmp/ds /tmp/requirements.txt
    ;;
  "kubealign ")
    $pip install --no-index --no-deps "$context"/own/kubealign-*.whl
    # every installed distribution's requirements met (the versions against the lock: tests/test_containers.py)
    $pip check
    ;;
  *)
    echo "usage: install.sh deps cpu|train, or install.sh kubealign" >&2
    exit 2
    ;;
esac
