"""Containers for real: the offline image build and the DAG in containers (marker `container`), and the
pieces of both that need no daemon (the apt mirror, the staged build context, the source hash, what the
containers are given).

The `container` tier installs Debian's docker.io and debootstrap when they are missing (root and apt
needed), starts kubealign's private dockerd, builds the CPU image through `kubealign images build`, runs
the shortened DAG with `--runner docker` and with the subprocess runner, compares them, and stops the
daemon. It skips, saying why, where it cannot. The daemon's data root (base image, layers) and the
wheelhouse stay in ~/.cache/kubealign-docker between runs: a second run is faster, a first run needs none
of it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kubealign import __version__, images
from kubealign.config import KubealignConfig
from kubealign.containers import base, build, daemon, runner
from tests.pipelines.test_kfp_local import SHORT  # the same shortened DAG as the kfp tier

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "requirements" / "lock-cpu.txt"
# Same wheels, same threads: the runners agree to float rounding. Measured on this machine: every metric
# but the measurements below equal to the last bit (a Debian 3.11.2 in the image, a 3.11.7 on the host).
METRIC_RTOL = 1e-6
MEASUREMENTS = ("_time_s", "wall_time_s", "per_s", "peak_memory_mb", "generation_share")


def locked() -> dict[str, str]:
    text = LOCK.read_text(encoding="utf-8")
    return {name.lower().replace("_", "-"): v for name, v in re.findall(r"^([\w.-]+)==(\S+)$", text, flags=re.M)}


# ---------------------------------------------------------------- no daemon needed


def test_apt_mirror_takes_the_bookworm_source_of_either_format(tmp_path: Path) -> None:
    d = tmp_path / "sources.list.d"
    d.mkdir()
    (d / "debian.sources").write_text(
        "Types: deb\n# a comment\nURIs: http://security.example/debian-security\nSuites: bookworm-security\n"
        "Components: main\n\nTypes: deb\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\n"
        "Components: main\n",
        encoding="utf-8",
    )
    assert base.apt_mirror((d,)) == "http://mirror.example/debian"
    legacy = tmp_path / "sources.list"
    legacy.write_text(
        "deb http://security.example/ bookworm-security main\ndeb [arch=amd64] http://old.example/debian bookworm main\n",
        encoding="utf-8",
    )
    assert base.apt_mirror((tmp_path / "absent", legacy)) == "http://old.example/debian"
    legacy.write_text("deb http://old.example/debian bullseye main\n", encoding="utf-8")
    with pytest.raises(Exception, match="no apt source for Debian bookworm"):
        base.apt_mirror((legacy,))


def test_source_hash_follows_the_code_and_not_the_bytecode(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    for name in build.SOURCE_DIRS:
        (repo / name).mkdir(parents=True)
        (repo / name / "a.py").write_text(f"# {name}\n", encoding="utf-8")
    (repo / "pyproject.toml").write_text("[project]\n", encoding="utf-8")
    first = build.source_sha256(repo)
    (repo / "kubealign" / "__pycache__").mkdir()
    (repo / "kubealign" / "__pycache__" / "a.pyc").write_bytes(b"\0")
    assert build.source_sha256(repo) == first
    (repo / "configs" / "a.py").write_text("# changed\n", encoding="utf-8")
    assert build.source_sha256(repo) != first
    (repo / "configs" / "a.py").write_text("# configs\n", encoding="utf-8")
    (repo / "configs" / "a.py").rename(repo / "configs" / "b.py")  # same bytes, another name
    assert build.source_sha256(repo) != first


def test_staged_context_holds_the_dockerfile_install_steps_and_two_wheel_dirs(tmp_path: Path) -> None:
    wheels = tmp_path / "wheelhouse"
    wheels.mkdir()
    for name in (
        "mlflow_skinny-3.17.2-py3-none-any.whl",
        "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",
        "deepspeed-0.19.8.tar.gz",
        ".complete",
    ):
        (wheels / name).write_bytes(b"x")
    context = build.stage_context(REPO, "cpu", wheels, tmp_path / "context")
    assert (context / "Dockerfile").read_bytes() == (REPO / "images" / "cpu" / "Dockerfile").read_bytes()
    assert (context / "install.sh").read_bytes() == (REPO / "images" / "install.sh").read_bytes()
    assert sorted(p.name for p in (context / "deps").iterdir()) == sorted(
        [
            "mlflow_skinny-3.17.2-py3-none-any.whl",
            "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",
            "deepspeed-0.19.8.tar.gz",
            "requirements.txt",
        ]
    )
    # what the dependency layer installs: each distribution once, normalized names, local versions kept
    required = (context / "deps" / "requirements.txt").read_text(encoding="utf-8").splitlines()
    assert required == ["deepspeed==0.19.8", "mlflow-skinny==3.17.2", "torch==2.13.0+cpu"]
    assert [p.name for p in (context / "own").iterdir()] == [f"kubealign-{__version__}-py3-none-any.whl"]


def test_containers_get_the_runs_environment_but_no_host_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "t")
    monkeypatch.setenv("KUBEALIGN_OP_LOCK_WAIT_S", "5")
    monkeypatch.setenv("KUBEALIGN_CACHE_DIR", "/host/cache")
    monkeypatch.setenv(daemon.STATE_ENV, "/host/docker")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("PATH", "/host/bin")
    env = runner.task_environment({"MLFLOW_TRACKING_URI": "sqlite:////out/mlflow.db", "MASTER_PORT": None})
    assert env["MLFLOW_TRACKING_TOKEN"] == "t" and env["KUBEALIGN_OP_LOCK_WAIT_S"] == "5"
    assert env["MLFLOW_TRACKING_URI"] == "sqlite:////out/mlflow.db"
    assert not {"KUBEALIGN_CACHE_DIR", daemon.STATE_ENV, "MASTER_PORT", "PATH"} & env.keys()


def test_inputs_outside_the_output_are_named(tmp_path: Path) -> None:
    data = tmp_path / "pairs.jsonl"
    data.write_text("{}\n", encoding="utf-8")
    out = tmp_path / "run"
    (out / "models" / "base").mkdir(parents=True)
    config = KubealignConfig.model_validate(
        {
            "data": {"sources": [{"path": "synthetic"}, {"path": str(data)}]},
            "reward": {"model": str(out / "models/base")},
        }
    )
    assert runner.host_paths(config, out) == [f"data.sources[1].path={data}"]


# ---------------------------------------------------------------- the container tier


def _skip_reason() -> str | None:
    if os.environ.get("DOCKER_HOST"):
        return (
            None
            if daemon.answers(os.environ["DOCKER_HOST"])
            else f"DOCKER_HOST={os.environ['DOCKER_HOST']} does not answer"
        )
    if os.geteuid() != 0:
        return "needs root to install and start dockerd (or DOCKER_HOST pointing at a daemon)"
    if shutil.which("dockerd") and shutil.which("debootstrap"):
        return None
    if not shutil.which("apt-get"):
        return "dockerd/debootstrap are missing and there is no apt-get to install them"
    return None


def _install_tools() -> None:
    missing = [
        pkg for tool, pkg in (("dockerd", "docker.io"), ("debootstrap", "debootstrap")) if not shutil.which(tool)
    ]
    if not missing:
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    update = subprocess.run(["apt-get", "update", "-qq"], capture_output=True, text=True, env=env, timeout=600)
    install = subprocess.run(
        ["apt-get", "install", "-y", "-qq", *missing], capture_output=True, text=True, env=env, timeout=900
    )
    if install.returncode != 0:
        pytest.skip(f"apt-get could not install {' '.join(missing)}: {(update.stderr + install.stderr).strip()[-300:]}")


@pytest.fixture(scope="module")
def docker_client():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    started = False
    if not os.environ.get("DOCKER_HOST"):
        _install_tools()
        started = not daemon.running()  # one already running (`kubealign images daemon start`) stays up
        os.environ["DOCKER_HOST"] = daemon.start()
    client = daemon.client()
    yield client
    client.close()
    if started:
        assert daemon.stop()
        assert not daemon.running()
        os.environ.pop("DOCKER_HOST", None)


@pytest.fixture(scope="module")
def cpu_image(docker_client, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """`kubealign images build` as a person runs it; returns what it printed and how long it took."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "kubealign.cli", "images", "build"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    return {"printed": done.stdout, "seconds": time.perf_counter() - started}


def _in_image(client, *command: str) -> str:
    out = client.containers.run(images.cpu_image(), list(command), remove=True, network_mode="none")
    return out.decode().strip()


@pytest.mark.container
def test_image_build_prints_what_it_built_with_its_size(cpu_image, docker_client) -> None:
    line = cpu_image["printed"].strip().splitlines()[-1]
    match = re.fullmatch(r"built (\S+): ([\d.]+) GB, Python (\S+), base (\S+), (\d+) s", line)
    assert match, cpu_image["printed"]
    assert match.group(1) == images.cpu_image()
    size = docker_client.images.get(images.cpu_image()).attrs["Size"]
    assert float(match.group(2)) == pytest.approx(size / 1e9, abs=0.006)
    assert match.group(3).startswith("3.11.")
    print(f"\nCPU image: {line} (the command took {cpu_image['seconds']:.0f} s)")


@pytest.mark.container
def test_image_runs_as_its_non_root_user(cpu_image, docker_client) -> None:
    assert _in_image(docker_client, "id", "-u") == "10001"
    assert docker_client.images.get(images.cpu_image()).attrs["Config"]["User"] == "10001:10001"


@pytest.mark.container
def test_nothing_in_the_images_venv_is_writable_but_by_root(cpu_image, docker_client) -> None:
    """install.sh's chmod (issue 37: a prebuilt op was world-writable): not one file or directory of the
    venv that group or others may write, links aside."""
    assert _in_image(docker_client, "find", "/opt/kubealign", "!", "-type", "l", "-perm", "/022") == ""
    assert _in_image(docker_client, "stat", "-c", "%U", "/opt/kubealign/bin/kubealign") == "root"


@pytest.mark.container
def test_versions_in_the_image_are_the_locked_ones(cpu_image, docker_client) -> None:
    # not pip freeze: it lists a wheel installed from a path as `name @ file://...`, with no version
    listing = "import importlib.metadata as m; print('\\n'.join(f\"{d.name}=={d.version}\" for d in m.distributions()))"
    frozen = _in_image(docker_client, "python", "-c", listing)
    inside = {
        name.lower().replace("_", "-"): version
        for name, version in re.findall(r"^([\w.-]+)==(\S+)$", frozen, flags=re.M)
    }
    lock = locked()
    assert inside.pop("kubealign") == __version__
    for name in ("torch", "deepspeed", "transformers", "kfp", "mlflow", "peft"):
        assert inside[name] == lock[name], name
    differing = {n: (v, lock[n]) for n, v in inside.items() if n in lock and lock[n] != v}
    assert not differing
    assert not set(inside) - set(lock) - {"pip", "setuptools", "wheel"}  # nothing from outside the lock
    labels = docker_client.images.get(images.cpu_image()).attrs["Config"]["Labels"]
    assert labels[build.SOURCE_LABEL] == build.source_sha256(REPO)


def _run_dag(out: Path, runner_name: str) -> tuple[dict, float, str]:
    command = [sys.executable, "-m", "kubealign.cli", "run", "--runner", runner_name, "--output", str(out)]
    command += [arg for item in SHORT for arg in ("--set", item)]
    started = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=2400)
    wall = time.perf_counter() - started
    assert done.returncode == 0, done.stdout[-4000:]
    return json.loads((out / "run.json").read_text(encoding="utf-8")), wall, done.stdout


def _phase_hashes(index: dict) -> dict[str, str]:
    manifest = json.loads((Path(index["stages"]["data-split"]["dir"]) / "manifest.json").read_text(encoding="utf-8"))
    return {phase: entry["files_sha256"] for phase, entry in manifest["phases"].items()}


def _result(index: dict, stage: str) -> dict:
    return json.loads((Path(index["stages"][stage]["dir"]) / "result.json").read_text(encoding="utf-8"))


@pytest.mark.container
def test_the_dag_in_containers_matches_the_subprocess_runner(cpu_image, docker_client, tmp_path: Path) -> None:
    in_docker, docker_s, printed = _run_dag(tmp_path / "docker", "docker")
    in_process, process_s, _ = _run_dag(tmp_path / "subprocess", "subprocess")
    assert in_docker["runner"] == "docker" and in_process["runner"] == "subprocess"
    assert (
        set(in_docker["stages"])
        == set(in_process["stages"])
        == {"data-split", "sft", "reward", "ppo", "evaluate", "promote"}
    )
    phases, other = _phase_hashes(in_docker), _phase_hashes(in_process)
    assert phases == other and len(phases) == 3
    for stage in ("sft", "reward", "ppo", "evaluate"):
        a, b = _result(in_docker, stage)["metrics"], _result(in_process, stage)["metrics"]
        assert a.keys() == b.keys(), stage
        for key in a:
            if isinstance(a[key], int | float) and not key.endswith(MEASUREMENTS):
                assert a[key] == pytest.approx(b[key], rel=METRIC_RTOL, abs=1e-6), f"{stage}.{key}"
    # the tasks ran as the image's user: what they wrote is 10001's
    ppo_dir = Path(in_docker["stages"]["ppo"]["dir"])
    assert {p.stat().st_uid for p in ppo_dir.rglob("*")} == {10001}
    assert _result(in_docker, "promote")["version"]
    print(f"\nDAG wall time: docker {docker_s:.0f} s, subprocess {process_s:.0f} s ({docker_s / process_s:.2f}x)")
    assert "promote" in printed


@pytest.mark.container
def test_the_charts_mlflow_server_runs_from_the_image_on_postgresql_and_s3(cpu_image, docker_client, tmp_path: Path):
    """The chart's production pod from the built CPU image: its init container (`mlflow db upgrade`) and
    its server, each with exactly the rendered command, args and env (tests/faults/test_production_stores.py
    fills in only what is host-specific) and the pod's restrictions (uid 10001, read-only root
    filesystem with /tmp writable, no capabilities), against a throwaway PostgreSQL and moto's S3 on this
    host; then a promotion through it."""
    from tests.faults.test_faults_registry import aliases, evaluation, promote
    from tests.faults.test_production_stores import BUCKET, Production
    from tests.support.stores import PostgresCluster, S3Server, ensure_postgresql

    reason = ensure_postgresql()
    if reason:
        pytest.skip(reason)
    pg, s3 = PostgresCluster().start(), S3Server(BUCKET).start()
    pod = {
        "network_mode": "host",
        "user": "10001:10001",
        "read_only": True,
        "tmpfs": {"/tmp": ""},
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
    }
    server = None
    try:
        prod = Production(tmp_path / "server", pg, s3)
        docker_client.containers.run(
            images.cpu_image(), prod.migration_argv, environment=prod.migration_vars, remove=True, **pod
        )  # raises ContainerError on a non-zero exit
        assert pg.query("SELECT count(*) FROM alembic_version") == [(1,)]
        server = docker_client.containers.run(
            images.cpu_image(), prod.server_argv, environment=prod.server_vars, detach=True, **pod
        )
        deadline = time.monotonic() + 180
        while True:
            server.reload()
            assert server.status == "running", server.logs()[-3000:].decode(errors="replace")
            try:
                with urllib.request.urlopen(f"{prod.url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, server.logs()[-3000:].decode(errors="replace")
            time.sleep(0.5)
        done, _ = promote(
            prod.url, "in-image", evaluation(tmp_path, "good", win=0.7, gain=0.3, reward=1.0), tmp_path / "out"
        )
        assert done.returncode == 0, done.stderr[-3000:] + server.logs()[-3000:].decode(errors="replace")
        assert aliases(prod.url, "in-image") == {"champion": "1", "challenger": "1"}
        assert any(k.endswith("/MLmodel") for k in s3.object_keys())
        assert pg.query("SELECT count(*) FROM model_versions WHERE name = 'in-image'") == [(1,)]
    finally:
        if server is not None:
            server.remove(force=True)
        s3.stop()
        pg.stop()
