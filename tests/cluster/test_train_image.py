"""The training image, built for real (marker `train_image`, a tier of its own: `make image-train`; not
run by `make test`, whose 45-minute budget the build would blow on 2 cores).

`kubealign images build --image train` as a person runs it, on the daemon the `container` tier uses (a
private dockerd, started and stopped here unless one runs): a wheelhouse of the lock with PyPI's CUDA torch
and CUDA compiler wheels (about 3 GB, once per lock), a debootstrapped or pulled Python base, DeepSpeed's
ops compiled in the build for TORCH_CUDA_ARCH_LIST (KUBEALIGN_CUDA_ARCH_LIST narrows it: each arch adds
minutes), then images/train/check.py inside the image. No GPU is needed, and none is used: whether the
kernels run is the gpu tier's question (benchmarks/gpu).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from kubealign import __version__, images
from kubealign.containers import build, daemon
from tests.cluster.test_containers import docker_client  # noqa: F401  # the fixture: a daemon, started if need be
from tests.cluster.test_images import TORCH_REQUIRES

pytestmark = pytest.mark.train_image

REPO = Path(__file__).resolve().parents[2]
ARCH_ENV = "KUBEALIGN_CUDA_ARCH_LIST"


@pytest.fixture(scope="module")
def train_image(docker_client) -> dict:  # noqa: F811
    """`kubealign images build --image train`; what it printed and how long it took."""
    command = [sys.executable, "-m", "kubealign.cli", "images", "build", "--image", "train"]
    if os.environ.get(ARCH_ENV):
        command += ["--cuda-arch-list", os.environ[ARCH_ENV]]
    started = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=7200)
    assert done.returncode == 0, done.stdout[-3000:]
    return {"printed": done.stdout, "seconds": time.perf_counter() - started}


def test_the_build_checks_the_image_and_prints_what_it_built(train_image, docker_client) -> None:  # noqa: F811
    lines = train_image["printed"].strip().splitlines()
    match = re.fullmatch(r"built (\S+): ([\d.]+) GB, Python (\S+), base (\S+), (\d+) s", lines[-1])
    assert match, train_image["printed"]
    assert match.group(1) == images.train_image() and match.group(3).startswith("3.11.")
    checked = lines[-2]
    cuda = images.TRAIN_CUDA_VERSION
    assert checked.startswith(
        f"checked in the image: torch 2.13.0+cu{cuda.replace('.', '')} (CUDA {cuda}), deepspeed 0.19.8"
    )
    assert "cpu_adam, fused_adam, transformer_inference prebuilt and loading" in checked and "uid 10001" in checked
    print(f"\ntrain image: {lines[-2]}\n{lines[-1]} (the command took {train_image['seconds']:.0f} s)")


def test_the_check_in_the_image_reports_cuda_torch_and_the_prebuilt_ops(train_image, docker_client) -> None:  # noqa: F811
    report = build.check_train(docker_client, images.train_image(), REPO)
    assert report["problems"] == [] and report["uid"] == 10001
    torch = report["torch"]
    assert torch["version"] == "2.13.0+cu130" and torch["cuda"] == images.TRAIN_CUDA_VERSION and torch["cuda_built"]
    assert torch["cudnn"] and not torch["cuda_available"]  # no GPU here
    ds = report["deepspeed"]
    assert ds["accelerator"] == "cuda" and ds["built_with"]["cuda_version"] == images.TRAIN_CUDA_VERSION
    assert set(ds["installed_ops"]) >= set(build.TRAIN_OPS) == set(ds["loaded"])
    assert ds["loaded"]["fused_adam"].startswith("ops/adam/fused_adam_op.")


def test_ds_report_lists_the_ops_as_installed(train_image, docker_client) -> None:  # noqa: F811
    """DeepSpeed's own report (what a user runs first), under the cuda accelerator as on a GPU node."""
    out = docker_client.containers.run(
        images.train_image(), ["ds_report"], remove=True, network_mode="none", environment={"DS_ACCELERATOR": "cuda"}
    ).decode()
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out)
    installed = set(re.findall(r"^(\w+) \.+ \[YES\]", plain, flags=re.M))
    assert installed == set(build.TRAIN_OPS), plain
    assert re.search(r"^deepspeed wheel compiled w\. \.+ torch 2\.13, cuda 13\.0$", plain, flags=re.M), plain


def test_the_image_runs_as_its_user_with_its_labels(train_image, docker_client) -> None:  # noqa: F811
    attrs = docker_client.images.get(images.train_image()).attrs
    assert attrs["Config"]["User"] == "10001:10001"
    labels = attrs["Config"]["Labels"]
    assert labels[build.SOURCE_LABEL] == build.source_sha256(REPO)
    assert labels["org.opencontainers.image.version"] == __version__
    assert labels["io.kubealign.cuda"] == images.TRAIN_CUDA_VERSION and labels["io.kubealign.torch"] == "2.13.0"
    assert labels["io.kubealign.cuda-arch-list"] == os.environ.get(ARCH_ENV, "8.0;8.6;8.9;9.0")
    no_compiler = "import shutil, sys; sys.exit(shutil.which('nvcc') is not None)"
    docker_client.containers.run(images.train_image(), ["python", "-c", no_compiler], remove=True, network_mode="none")


def test_torch_s_metadata_requires_what_tests_test_images_recorded() -> None:
    """The wheel in the wheelhouse, against the requirements tests/cluster/test_images.py checks the pins with."""
    found = sorted(daemon.state_dir().glob("wheelhouse-train-*/torch-*.whl"))
    if not found:
        pytest.skip("no train wheelhouse (the build makes it)")
    with zipfile.ZipFile(found[-1]) as wheel:
        metadata = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        text = wheel.read(metadata).decode()
    linux = []
    for line in re.findall(r"^Requires-Dist: (.+)$", text, flags=re.M):
        requirement = Requirement(line)
        marker = str(requirement.marker or "")
        if "extra ==" not in marker and (not marker or requirement.marker.evaluate({"platform_system": "Linux"})):
            linux.append(str(requirement).split(";")[0].strip())
    lock_names = {
        re.sub(r"[-_.]+", "-", n.lower())
        for n in re.findall(
            r"^([\w.-]+)==", (REPO / "requirements" / "lock-cpu.txt").read_text(encoding="utf-8"), flags=re.M
        )
    }
    beyond_lock = sorted(r for r in linux if Requirement(r).name not in lock_names)
    assert beyond_lock == sorted(str(Requirement(r)) for r in TORCH_REQUIRES)
