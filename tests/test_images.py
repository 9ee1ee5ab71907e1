"""images/: hadolint passes, the versions the Dockerfiles pin are the locked ones, and the image
references the components use come from kubealign.images."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kubealign import __version__, images

REPO = Path(__file__).resolve().parents[1]
DOCKERFILES = {name: REPO / "images" / name / "Dockerfile" for name in ("train", "cpu")}


def args(dockerfile: Path) -> dict[str, str]:
    """ARG NAME=default values of a Dockerfile (later stages repeat some; they must agree)."""
    found: dict[str, str] = {}
    for name, value in re.findall(r"^ARG (\w+)=(\S+)$", dockerfile.read_text(encoding="utf-8"), flags=re.M):
        value = value.strip('"')
        assert found.setdefault(name, value) == value, f"{dockerfile}: ARG {name} has two defaults"
    return found


def lock() -> dict[str, str]:
    text = (REPO / "requirements" / "lock-cpu.txt").read_text(encoding="utf-8")
    return {name.lower(): version for name, version in re.findall(r"^([\w.-]+)==(\S+)$", text, flags=re.M)}


def from_lines(dockerfile: Path) -> list[str]:
    values = args(dockerfile)
    lines = re.findall(r"^FROM (\S+)", dockerfile.read_text(encoding="utf-8"), flags=re.M)
    return [re.sub(r"\$\{(\w+)\}", lambda m: values[m.group(1)], line) for line in lines]


@pytest.mark.parametrize("name", list(DOCKERFILES))
def test_hadolint_passes(name: str) -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    proc = subprocess.run([str(hadolint), str(DOCKERFILES[name])], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", list(DOCKERFILES))
def test_every_hadolint_ignore_is_justified(name: str) -> None:
    lines = DOCKERFILES[name].read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore" in line:
            assert lines[i - 1].startswith("#") and "hadolint" not in lines[i - 1], f"{name}:{i + 1} has no reason"


def test_pinned_versions_match_the_lock() -> None:
    locked = lock()
    torch = locked["torch"].split("+")[0]  # the lock holds the CPU build, 2.13.0+cpu
    for name, dockerfile in DOCKERFILES.items():
        pinned = args(dockerfile)
        assert pinned["TORCH_VERSION"] == torch, name
        assert pinned["VERSION"] == __version__, name
    assert args(DOCKERFILES["train"])["DEEPSPEED_VERSION"] == locked["deepspeed"]
    assert args(DOCKERFILES["cpu"])["DEEPSPEED_VERSION"] == locked["deepspeed"]
    python = re.fullmatch(r"python:([\d.]+)-bookworm", args(DOCKERFILES["cpu"])["BASE_IMAGE"]).group(1)
    header = (REPO / "requirements" / "lock-cpu.txt").read_text(encoding="utf-8").splitlines()[0]
    assert f"Python {'.'.join(python.split('.')[:2])}" in header  # the lock was resolved for this Python


def test_both_images_install_through_the_one_offline_step() -> None:
    for name, dockerfile in DOCKERFILES.items():
        text = dockerfile.read_text(encoding="utf-8")
        assert f"RUN sh /tmp/context/install.sh deps {name}\n" in text, name
        assert "RUN sh /tmp/context/install.sh kubealign" in text, name
        assert "pip install" not in text and "pip wheel" not in text, name  # only install.sh installs
    script = (REPO / "images" / "install.sh").read_text(encoding="utf-8")
    pip_lines = [line for line in script.splitlines() if "$pip install" in line or "$pip wheel" in line]
    assert len(pip_lines) == 4 and all("--no-index" in line for line in pip_lines)


def test_base_images_are_the_ones_kubealign_names() -> None:
    assert from_lines(DOCKERFILES["train"])[-1] == images.CUDA_BASE_IMAGE
    assert from_lines(DOCKERFILES["cpu"])[-1] == images.CPU_BASE_IMAGE
    assert from_lines(DOCKERFILES["train"])[0].endswith("-devel")  # ops compile against the CUDA toolkit


def test_image_references(monkeypatch: pytest.MonkeyPatch) -> None:
    assert images.train_image() == f"ghcr.io/kubealign/kubealign-train:{__version__}"
    monkeypatch.setenv(images.REGISTRY_ENV, "registry.internal:5000/ml/")
    assert images.cpu_image() == f"registry.internal:5000/ml/kubealign-cpu:{__version__}"
    chart = yaml.safe_load((REPO / "charts" / "kubealign" / "Chart.yaml").read_text(encoding="utf-8"))
    assert chart["appVersion"] == __version__  # the chart's default tag is the package's image tag


def test_components_take_their_image_from_kubealign_images() -> None:
    from kubealign.components import stages

    used = {c.component_spec.implementation.container.image for c in
            (stages.data_split, stages.sft, stages.reward, stages.ppo, stages.evaluate, stages.promote)}  # fmt: skip
    assert used == {images.TRAIN_IMAGE, images.CPU_IMAGE}
    source = (REPO / "components" / "stages.py").read_text(encoding="utf-8")
    assert 'base_image="' not in source and "packages_to_install" not in source


def test_the_cpu_image_carries_the_mlflow_servers_production_store_clients() -> None:
    """The chart's MLflow server runs from the CPU image, whose dependencies are kubealign's runtime ones
    at the lock's versions: a PostgreSQL store needs a driver for both URI forms (SQLAlchemy 2.1 opens
    postgresql:// with psycopg 3; postgresql+psycopg2:// is MLflow's documented form) and an S3 artifact
    store needs boto3."""
    import importlib.metadata

    import sqlalchemy

    runtime = {
        re.split(r"[<>=!~;\[ ]", req)[0].lower()
        for req in importlib.metadata.requires("kubealign") or []
        if "extra ==" not in req
    }
    locked = lock()
    for name in ("psycopg", "psycopg2-binary", "boto3"):
        assert name in runtime and name in locked, name
    for name in ("psycopg-binary", "botocore", "s3transfer", "jmespath"):  # theirs, pinned alike
        assert name in locked, name
    for uri, driver in (("postgresql://", "psycopg"), ("postgresql+psycopg2://", "psycopg2")):
        engine = sqlalchemy.create_engine(f"{uri}mlflow@127.0.0.1:1/mlflow")  # loads the driver, connects never
        assert engine.dialect.driver == driver
    import boto3  # noqa: F401  # what MLflow's S3 artifact repository imports
