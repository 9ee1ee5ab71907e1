"""`kubealign images build` (make images): offline, reproducible image builds.

1. A wheelhouse on the host: every runtime dependency at the lock's version (`pip wheel -c lock`),
   kept in state_dir() under the lock's and pyproject's hash (made once per lock, about a minute);
   kubealign's own wheel is made fresh for every build.
2. A staged build context: the image's Dockerfile, images/install.sh, the lock and the wheels. The
   build runs with no network (network_mode none) and installs with --no-index: what it installs is
   exactly what the wheelhouse holds.
   The train image's wheelhouse swaps the lock's +cpu torch for PyPI's CUDA build and the CUDA
   libraries it requires, and adds CUDA's compiler for its build stage and DeepSpeed's sdist: the
   versions of images/train/cuda.txt and cuda-build.txt, every one pinned (checked here).
   The serve image's is kubealign/serving/lock-serve.txt's wheels (vLLM's CPU build, no kubealign) and
   Debian's libnuma1 (SERVE_DEBS, fetched with apt-get download), which vLLM's CPU ops link.
3. The base: --base IMAGE, or `auto`: the Dockerfile's Python image if the daemon has it or can pull
   it, else a Debian bookworm made here with debootstrap (kubealign.containers.base). Both images.
4. The train image is then checked inside (images/train/check.py): its torch a CUDA build, DeepSpeed's
   ops prebuilt and loading, every distribution at the lock's or cuda.txt's version, its user.

It prints what it built, with sizes; the daemon's build output goes to state_dir()/build-<image>.log.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubealign import __version__, images
from kubealign.containers import base
from kubealign.containers.daemon import state_dir
from kubealign.errors import UserError

FLAVOURS = {"cpu": images.cpu_image, "train": images.train_image, "serve": images.serve_image}
SOURCE_DIRS = ("kubealign", "components", "pipelines", "configs")
SOURCE_LABEL = "io.kubealign.source-sha256"
# The train image's distributions beyond the lock (runtime) and its build stage's CUDA compiler.
CUDA_PINS = ("cuda.txt", "cuda-build.txt")
TRAIN_OPS = ("fused_adam", "transformer_inference", "cpu_adam")  # the Dockerfile's DS_BUILD_* ones
SERVE_LOCK = ("kubealign", "serving", "lock-serve.txt")
SERVE_DEBS = ("libnuma1=2.0.16-1",)  # Debian bookworm's; the bootstrapped base lacks it, vLLM's _C links it


@dataclass(frozen=True)
class Built:
    image: str
    base: str
    seconds: float
    size_bytes: int
    python: str
    check: dict[str, Any] | None = None  # the train image's in-image report (images/train/check.py)


def repo_root() -> Path:
    """The source checkout the images are built from (this package's, for an editable install; else cwd)."""
    import kubealign

    for candidate in (Path(kubealign.__file__).resolve().parents[1], Path.cwd()):
        if (candidate / "images" / "cpu" / "Dockerfile").is_file() and (candidate / "pyproject.toml").is_file():
            return candidate
    raise UserError("images are built from a kubealign source checkout: run this in one (images/ not found)")


def source_sha256(repo: Path) -> str:
    """Content hash of the code an image carries (labelled on it, compared by `run --runner docker`)."""
    digest = hashlib.sha256()
    files: list[Path] = [repo / "pyproject.toml"]
    for name in SOURCE_DIRS:
        files += [p for p in (repo / name).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    for path in sorted(files):
        digest.update(path.relative_to(repo).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def _pip(args: list[str], what: str) -> None:
    env = {**os.environ, "DS_BUILD_OPS": "0"}  # DeepSpeed's wheel stays pure Python (its ops JIT where used)
    proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if "ERROR" in line] or proc.stderr.splitlines()[-1:]
        raise UserError(f"{what} failed: {errors[0] if errors else f'pip exit {proc.returncode}'}")


def wheelhouse(repo: Path, flavour: str, say: Callable[[str], None]) -> Path:
    """The dependency wheels for `flavour` (cached by the lock's and pyproject's content)."""
    lock = repo / "requirements" / "lock-cpu.txt"
    keyed = [lock, repo / "pyproject.toml"] + (
        [repo / "images" / "train" / n for n in CUDA_PINS] if flavour == "train" else []
    )
    salt = b""
    if flavour == "serve":
        keyed, salt = [repo.joinpath(*SERVE_LOCK)], " ".join(SERVE_DEBS).encode()
    key = hashlib.sha256(b"".join(path.read_bytes() for path in keyed) + salt).hexdigest()[:16]
    cached = state_dir() / f"wheelhouse-{flavour}-{key}"
    if (cached / ".complete").is_file():
        return cached
    say(f"making the wheelhouse from {keyed[0].relative_to(repo)} (once per lock)")
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cached.name}-", dir=cached.parent))
    try:
        if flavour == "serve":
            _serve_files(keyed[0], tmp)
        else:
            # [eval]: lm-eval-harness, so evaluate.suites runs in the image as it does here
            args = ["wheel", "-q", "-c", str(lock), "--wheel-dir", str(tmp), f"{repo}[eval]"]
            _pip(args, "pip wheel (the wheelhouse)")
            for own in tmp.glob("kubealign-*.whl"):
                own.unlink()  # made fresh for every build
        if flavour == "train":
            _cuda_wheels(repo, lock, tmp)
            # compiled inside the CUDA build with its ops; the lock's version, as a source distribution
            deepspeed = next(line for line in lock.read_text().splitlines() if line.startswith("deepspeed=="))
            _pip(["download", "-q", "--no-deps", "--no-binary", ":all:", "-d", str(tmp), deepspeed], "pip download")
        (tmp / ".complete").touch()
        shutil.rmtree(cached, ignore_errors=True)  # an incomplete one (no .complete) from a killed build
        tmp.rename(cached)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return cached


def _serve_files(lock: Path, dest: Path) -> None:
    """lock-serve.txt's wheels (binary only, --no-deps: the lock is the whole venv) and SERVE_DEBS into dest."""
    _pip(["download", "-q", "--no-deps", "--only-binary", ":all:", "-r", str(lock), "-d", str(dest)], "pip download")
    (dest / "debs").mkdir()
    try:
        proc = subprocess.run(["apt-get", "download", *SERVE_DEBS], cwd=dest / "debs", capture_output=True, text=True)
    except FileNotFoundError:
        raise UserError("the serve image needs Debian's apt-get to fetch libnuma1 (not found)") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        raise UserError(f"apt-get download {' '.join(SERVE_DEBS)} failed: {last}")


def pins(path: Path) -> dict[str, str]:
    """normalized name -> version of a requirements file's `name==version` (or `===`) lines."""
    found = re.findall(
        r"^([A-Za-z0-9][\w.-]*)(?:\[[^]]*\])?===?([^\s;,]+)", path.read_text(encoding="utf-8"), flags=re.M
    )
    return {re.sub(r"[-_.]+", "-", name).lower(): version for name, version in found}


def _cuda_wheels(repo: Path, lock: Path, wheels: Path) -> None:
    """Replace the +cpu torch in `wheels` by PyPI's CUDA build and what it requires, plus the CUDA compiler
    wheels, resolved by pip against the lock and images/train/cuda*.txt: a pin that disagrees with torch's
    requirements fails here, and a requirement nothing pins is refused (the image would float)."""
    for old in wheels.glob("torch-*.whl"):
        old.unlink()
    train = repo / "images" / "train"
    constraints = wheels.parent / f".{wheels.name}-constraints.txt"
    lines = [line for line in lock.read_text(encoding="utf-8").splitlines() if not line.startswith("torch==")]
    constraints.write_text("\n".join(lines) + "\n", encoding="utf-8")
    try:
        args = ["download", "-q", "--only-binary", ":all:", "-c", str(constraints), "-d", str(wheels)]
        _pip([*args, *(arg for name in CUDA_PINS for arg in ("-r", str(train / name)))], "pip download (CUDA wheels)")
    finally:
        constraints.unlink()
    pinned = {**pins(lock), **pins(train / "cuda.txt"), **pins(train / "cuda-build.txt")}
    floating = unpinned(requirements(wheels), pinned)
    if floating:
        raise UserError(
            f"the train wheelhouse holds {', '.join(floating)}, pinned by neither the lock nor images/train/cuda*.txt"
        )


def unpinned(requirements_txt: str, pinned: dict[str, str]) -> list[str]:
    """The `name==version` lines of requirements_txt whose version `pinned` does not give."""
    lines = [line for line in requirements_txt.splitlines() if "==" in line]
    return [line for line in lines if pinned.get(re.sub(r"[-_.]+", "-", line.split("==")[0])) != line.split("==")[1]]


def _link_or_copy(files: Iterable[Path], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for path in files:
        try:
            os.link(path, dest / path.name)
        except OSError:  # another filesystem
            shutil.copy2(path, dest / path.name)


def requirements(wheels: Path) -> str:
    """`name==version` of every wheel and sdist in the wheelhouse: what the dependency layer installs."""
    lines = set()
    for path in wheels.iterdir():
        if path.name.endswith(".whl"):
            name, version = path.name.split("-")[:2]
        elif path.name.endswith(".tar.gz"):
            name, version = path.name[: -len(".tar.gz")].rsplit("-", 1)
        else:
            continue
        lines.add(f"{name.replace('_', '-').lower()}=={version}")
    return "".join(f"{line}\n" for line in sorted(lines))


def stage_context(repo: Path, flavour: str, wheels: Path, dest: Path) -> Path:
    """The build context: Dockerfile, install.sh, deps/ (the wheelhouse + requirements.txt), own/ (kubealign);
    the serve image's: deps/ (lock-serve.txt's wheels, the lock as requirements.txt) and debs/."""
    dest.mkdir(parents=True)
    shutil.copy2(repo / "images" / flavour / "Dockerfile", dest / "Dockerfile")
    shutil.copy2(repo / "images" / "install.sh", dest / "install.sh")
    if flavour == "train":
        for name in CUDA_PINS:
            shutil.copy2(repo / "images" / "train" / name, dest / name)
    if flavour == "serve":  # vLLM alone: the lock is its requirements, libnuma1 beside, no kubealign wheel
        _link_or_copy([p for p in wheels.iterdir() if p.name.endswith(".whl")], dest / "deps")
        _link_or_copy((wheels / "debs").iterdir(), dest / "debs")
        shutil.copy2(repo.joinpath(*SERVE_LOCK), dest / "deps" / "requirements.txt")
        return dest
    _link_or_copy([p for p in wheels.iterdir() if p.name != ".complete"], dest / "deps")
    (dest / "deps" / "requirements.txt").write_text(requirements(wheels), encoding="utf-8")
    _pip(["wheel", "-q", "--no-deps", "--wheel-dir", str(dest / "own"), str(repo)], "pip wheel (kubealign)")
    return dest


def choose_base(client: Any, requested: str, flavour: str, say: Callable[[str], None]) -> str:
    """The BASE_IMAGE build argument. Both images build on a Python 3.11 Debian: the train image's CUDA
    comes from torch's wheels, not from the base."""
    default = images.TRAIN_BASE_IMAGE if flavour == "train" else images.CPU_BASE_IMAGE
    if requested == "bootstrap":
        return base.bootstrap(client, say)
    if requested != "auto":
        if not base.exists(client, requested):
            raise UserError(f"--base {requested}: the daemon has no such image (load or pull it first)")
        return requested
    if base.exists(client, default):
        return default
    try:
        repository, tag = default.rsplit(":", 1)
        client.images.pull(repository, tag=tag)
        return default
    except Exception as exc:
        say(f"{default} cannot be pulled ({str(exc).splitlines()[0][:120]}); using a bootstrapped base")
    return base.bootstrap(client, say)


def build(
    client: Any,
    flavour: str = "cpu",
    base_image: str = "auto",
    say: Callable[[str], None] = print,
    cuda_arch_list: str | None = None,
) -> Built:
    """Build one image offline; returns what was built. cuda_arch_list: the train image's
    TORCH_CUDA_ARCH_LIST (default: the Dockerfile's)."""
    if flavour not in FLAVOURS:
        raise UserError(f"unknown image {flavour!r}: choose one of {', '.join(FLAVOURS)}")
    if cuda_arch_list is not None and (
        flavour != "train" or not re.fullmatch(r"\d+\.\d+(\+PTX)?(;\d+\.\d+(\+PTX)?)*", cuda_arch_list)
    ):
        raise UserError(f"--cuda-arch-list {cuda_arch_list!r}: the train image's, as '8.0;9.0' (optionally 9.0+PTX)")
    repo = repo_root()
    tag = FLAVOURS[flavour]()
    started = time.perf_counter()
    chosen = choose_base(client, base_image, flavour, say)
    wheels = wheelhouse(repo, flavour, say)
    log = state_dir() / f"build-{flavour}.log"
    with tempfile.TemporaryDirectory(prefix="kubealign-context-") as tmp:
        context = stage_context(repo, flavour, wheels, Path(tmp) / "context")
        buildargs = {
            "BASE_IMAGE": chosen,
            "VERSION": __version__,
            "SOURCE_SHA256": source_sha256(repo),
            "REVISION": _revision(repo),
            "CREATED": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        if cuda_arch_list:
            buildargs["TORCH_CUDA_ARCH_LIST"] = cuda_arch_list
        say(f"building {tag} from {chosen} (log: {log})")
        _stream_build(client, context, tag, buildargs, log)
    # the image this tag held before is now untagged: drop it (and its layers), or every rebuild adds ~2 GB
    client.images.prune(filters={"dangling": True})
    image = client.images.get(tag)
    python = (
        client.containers.run(
            tag, ["python", "-c", "import platform; print(platform.python_version())"], remove=True, network_mode="none"
        )
        .decode()
        .strip()
    )
    report = check_train(client, tag, repo) if flavour == "train" else None
    return Built(tag, chosen, time.perf_counter() - started, int(image.attrs["Size"]), python, report)


def train_expectations(repo: Path) -> dict[str, Any]:
    """What images/train/check.py checks the train image against: the lock's versions with
    images/train/cuda.txt's over them (torch's CUDA build for the lock's +cpu one), no build-only wheel."""
    train = repo / "images" / "train"
    versions = {**pins(repo / "requirements" / "lock-cpu.txt"), **pins(train / "cuda.txt"), "kubealign": __version__}
    cuda = re.search(r"^ARG CUDA_VERSION=(\S+)$", (train / "Dockerfile").read_text(encoding="utf-8"), flags=re.M)
    return {
        "uid": 10001,
        "cuda": cuda.group(1) if cuda else "",
        "ops": list(TRAIN_OPS),
        "versions": versions,
        "required": sorted({*pins(train / "cuda.txt"), "deepspeed", "kubealign"}),
        "allowed": ["pip"],  # the venv's own; setuptools is in the lock
        "absent": sorted(pins(train / "cuda-build.txt")),
    }


def check_train(client: Any, tag: str, repo: Path) -> dict[str, Any]:
    """Run images/train/check.py in the built image (no network, as its user); its report, or a UserError
    naming the problems it found."""
    script = (repo / "images" / "train" / "check.py").read_text(encoding="utf-8")
    command = ["python", "-c", script, json.dumps(train_expectations(repo))]
    container = client.containers.run(tag, command, detach=True, network_mode="none")
    try:
        container.wait(timeout=300)
        out = container.logs(stdout=True, stderr=False).decode()
        err = container.logs(stdout=False, stderr=True).decode()
    finally:
        container.remove(force=True)
    lines = [line for line in out.strip().splitlines() if line.startswith("{")]
    if not lines:
        raise UserError(f"the check in {tag} printed no report: {(out + err).strip()[-300:]}")
    report = json.loads(lines[-1])
    if report["problems"]:
        raise UserError(f"{tag} fails its check: {'; '.join(report['problems'])}")
    return report


def _revision(repo: Path) -> str:
    proc = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    return proc.stdout.strip() if proc.returncode == 0 else "unknown"


def _stream_build(client: Any, context: Path, tag: str, buildargs: dict[str, str], log: Path) -> None:
    """docker build with no network; every line to `log`; a failed step raises with its last line."""
    last = ""
    with log.open("w", encoding="utf-8") as sink:
        stream = client.api.build(
            path=str(context), tag=tag, buildargs=buildargs, network_mode="none", rm=True, forcerm=True, decode=True
        )
        for chunk in stream:
            text = chunk.get("stream") or chunk.get("status") or ""
            if text:
                sink.write(text if text.endswith("\n") else text + "\n")
                last = text.strip() or last
            if "error" in chunk:
                sink.write(chunk["error"] + "\n")
                raise UserError(f"building {tag} failed: {chunk['error'].strip()} (log: {log})")
    if not last.startswith("Successfully tagged"):
        raise UserError(f"building {tag} did not finish: {last} (log: {log})")
