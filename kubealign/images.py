"""The container images kubealign's KFP components and TrainJobs run in: the one place they are named.

All three are built from images/ (see docs/deploy.md "Build the images") and tagged with the package version, so
a compiled pipeline always points at the image that carries the same kubealign code. A registry mirror
is one environment variable away (KUBEALIGN_IMAGE_REGISTRY), or override a single image per config
(kubernetes.train_image / kubernetes.cpu_image).
"""

from __future__ import annotations

import os

from kubealign import __version__

REGISTRY_ENV = "KUBEALIGN_IMAGE_REGISTRY"
DEFAULT_REGISTRY = "ghcr.io/kubealign"

# The bases images/*/Dockerfile build FROM by default (`kubealign images build --base` picks another, or a
# debootstrapped Debian where no registry is reachable); tests/cluster/test_images.py checks them (and the torch,
# CUDA, deepspeed and Python versions) against the Dockerfiles, requirements/lock-cpu.txt and
# images/train/cuda.txt.
# Not the slim variant: DeepSpeed on CPU JIT-compiles an op at start-up and needs g++ and the Python headers,
# which slim lacks and an offline build cannot apt-get.
CPU_BASE_IMAGE = "python:3.11.7-bookworm"
# No CUDA base image: PyPI's torch wheels carry the CUDA runtime libraries (the driver comes from the node),
# and DeepSpeed's ops are compiled in the build by PyPI's CUDA compiler wheels. The same Python as the CPU
# image, so that one wheelhouse of the lock serves both.
TRAIN_BASE_IMAGE = CPU_BASE_IMAGE
# The CUDA torch 2.13.0 from PyPI is built for (torch.version.cuda), which the ops are compiled with.
TRAIN_CUDA_VERSION = "13.0"


def _registry() -> str:
    return os.environ.get(REGISTRY_ENV, DEFAULT_REGISTRY).rstrip("/")


def train_image() -> str:
    """CUDA image: torch + deepspeed with prebuilt ops + kubealign (sft, reward, ppo on GPUs)."""
    return f"{_registry()}/kubealign-train:{__version__}"


def cpu_image() -> str:
    """Slim CPU image: CPU torch + kubealign (data-split, evaluate, promote; CPU-only clusters)."""
    return f"{_registry()}/kubealign-cpu:{__version__}"


def serve_image() -> str:
    """vLLM's OpenAI server on CPU (images/serve): the vllm runtime's image for a predictor without GPUs."""
    return f"{_registry()}/kubealign-serve:{__version__}"


TRAIN_IMAGE = train_image()
CPU_IMAGE = cpu_image()
