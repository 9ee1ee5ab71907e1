"""Serving the champion (issue 38): the InferenceService a registry alias becomes, and putting it in a cluster.

The registry is a real `mlflow server` serving its artifacts (as the chart's does) with a version that
`kubealign promote` registered; the cluster is tests/support/kube_standin.py, the real `kubernetes` client against a
stand-in API on 127.0.0.1 that checks what it stores against KServe v0.20.0's CRD schema.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kubealign import images
from kubealign.config.serve import ServeConfig
from kubealign.errors import UserError
from kubealign.serving import deploy
from kubealign.serving.chat import plain_template
from kubealign.serving.location import Served, missing_files, storage_uri
from kubealign.serving.manifest import dns_name, inference_service
from tests.faults.test_faults_registry import evaluation, kubealign, one_line_error, promote
from tests.stages.test_judge import split as split_dir  # noqa: F401 (the data-split fixture)
from tests.support.faults import MlflowServer
from tests.support.k8s_schemas import errors
from tests.support.kube_standin import StandInKube

pytestmark = pytest.mark.faults

NAME, DESTINATION = "serve-actor", "pvc://kubealign-mlflow/artifacts"


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory):
    """A server serving its artifacts under ROOT/artifacts, with version 1 of NAME as champion."""
    root = tmp_path_factory.mktemp("serve")
    server = MlflowServer(root).start()
    done, _ = promote(server.url, NAME, evaluation(root, "e0", win=0.7, gain=0.3, reward=1.0), root / "p0")
    assert done.returncode == 0, done.stderr[-3000:]
    yield server
    server.kill()


def manifest(registry: MlflowServer, tmp_path: Path, *sets: str, alias: str | None = None) -> dict:
    args = [
        "serve",
        "--tracking-uri",
        registry.url,
        "--set",
        f"promote.registered_model={NAME}",
        "--namespace",
        "team-a",
        "--manifest",
        tmp_path / "isvc.yaml",
        *[a for s in sets for a in ("--set", s)],
    ]
    done, _ = kubealign(registry.url, *args, *(["--alias", alias] if alias else []))
    assert done.returncode == 0, done.stderr[-3000:]
    return yaml.safe_load((tmp_path / "isvc.yaml").read_text(encoding="utf-8"))


def manifest_here(registry: MlflowServer, tmp_path: Path, *sets: str) -> dict:
    """manifest() in this process (the CLI's main): the same command without a process start."""
    args = [
        "serve",
        "--tracking-uri",
        registry.url,
        "--set",
        f"promote.registered_model={NAME}",
        "--namespace",
        "team-a",
        "--manifest",
        tmp_path / "here.yaml",
        *[a for s in sets for a in ("--set", s)],
    ]
    code, err = in_process(*args)
    assert code == 0, err
    return yaml.safe_load((tmp_path / "here.yaml").read_text(encoding="utf-8"))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_manifest_serves_the_registered_bytes(registry: MlflowServer, tmp_path: Path) -> None:
    from kubealign.models import loading

    body = manifest(registry, tmp_path, f"serve.artifacts_destination={DESTINATION}")
    assert errors(body) == []
    model = body["spec"]["predictor"]["model"]
    assert model["modelFormat"] == {"name": "huggingface"} and model["runtime"] == "kserve-huggingfaceserver"
    assert model["resources"]["limits"] == {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"}
    # the storage URI is the registered HF directory below the server's artifacts destination: the same path
    # below this server's --artifacts-destination holds exactly the promoted model's files
    uri = model["storageUri"]
    assert uri.startswith(f"{DESTINATION}/")
    on_disk = registry.root / "artifacts" / uri.removeprefix(f"{DESTINATION}/")
    promoted = Path(loading.resolve("tiny-opt"))  # what promote_args registers (the evaluated candidate)
    assert list(promoted.glob("*.safetensors"))
    for weights in promoted.glob("*.safetensors"):
        assert sha256(on_disk / weights.name) == sha256(weights)
    assert (on_disk / "config.json").read_bytes() == (promoted / "config.json").read_bytes()
    meta = body["metadata"]
    assert meta["name"] == NAME and meta["namespace"] == "team-a"
    assert meta["labels"]["networking.kserve.io/visibility"] == "cluster-local"
    assert meta["labels"]["kubealign.io/alias"] == "champion" and meta["labels"]["kubealign.io/model-version"] == "1"
    assert meta["annotations"]["kubealign.io/model-uri"] == f"models:/{NAME}/1"
    # the version's digests travel with it, for a storage initializer or runtime that checks what it downloads
    recorded = json.loads((on_disk.parent.parent / "provenance.json").read_text(encoding="utf-8"))
    assert meta["annotations"]["kubealign.io/model-sha256"] == recorded["model_sha256"]
    files = json.loads(meta["annotations"]["kubealign.io/files-sha256"])
    assert files == recorded["files"] and files["model.safetensors"] == sha256(on_disk / "model.safetensors")


@contextlib.contextmanager
def flipped_byte(registry: MlflowServer) -> Iterator[Path]:
    """One byte of the registered weights flipped where the registry stores them (its artifacts destination),
    put back afterwards: the other tests of this module share the registry."""
    weights = next((registry.root / "artifacts").rglob("model/artifacts/*/model.safetensors"))
    data = weights.read_bytes()
    weights.write_bytes(data[:-9] + bytes([data[-9] ^ 0x10]) + data[-8:])
    try:
        yield weights
    finally:
        weights.write_bytes(data)


def test_a_flipped_byte_in_the_registry_is_refused_before_anything_is_served(
    registry: MlflowServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest of `kubealign serve --manifest` (what the serve task applies) and the copy `kubealign serve` and
    `feedback push` load: both refuse in one line naming the file, and nothing is written."""
    from kubealign.serving.local import resolved

    monkeypatch.setenv("KUBEALIGN_CACHE_DIR", str(tmp_path / "cache"))
    args = ["serve", "--tracking-uri", registry.url, "--set", f"promote.registered_model={NAME}"]
    args += ["--set", f"serve.artifacts_destination={DESTINATION}", "--namespace", "team-a"]
    with flipped_byte(registry):
        done, _ = kubealign(registry.url, *args, "--manifest", tmp_path / "isvc.yaml")
        assert done.returncode == 2
        line = one_line_error(done)
        assert line.startswith(f"kubealign: error: serve: {NAME} version 1: model.safetensors has sha256 "), line
        assert line.endswith("the files are not the registered ones; refusing to load them")
        assert not (tmp_path / "isvc.yaml").exists()
        with pytest.raises(UserError, match=f"^serve: {NAME} version 1: model.safetensors has sha256"):
            resolved(ServeConfig(), registry.url, NAME, ["champion"])
    # put back: the cached copy, which holds the flipped byte, is downloaded again and now matches
    [(_, copy)] = resolved(ServeConfig(), registry.url, NAME, ["champion"])
    assert sha256(copy / "model.safetensors") == sha256(
        next(registry.root.rglob("model/artifacts/*/model.safetensors"))
    )
    (copy / "config.json").write_text("{}")  # someone writes into the cache: served files are fetched again
    [(_, again)] = resolved(ServeConfig(), registry.url, NAME, ["champion"])
    assert again == copy and json.loads((copy / "config.json").read_text())


def test_vllm_on_cpu_in_public(registry: MlflowServer, tmp_path: Path) -> None:
    sets = [
        f"serve.artifacts_destination={DESTINATION}",
        "serve.runtime=vllm",
        "serve.gpus=0",
        "serve.public=true",
        "serve.max_model_len=512",
        "serve.name=chat",
        "serve.service_account=s3-reader",
    ]
    body = manifest(registry, tmp_path, *sets)
    assert errors(body) == []
    predictor = body["spec"]["predictor"]
    assert predictor["serviceAccountName"] == "s3-reader"
    model = predictor["model"]
    assert model["modelFormat"] == {"name": "vLLM"} and model["runtime"] == "kserve-vllmserver"
    # vLLM's CPU build from images/serve, in fp32 with its KV cache sized, and the chat template training's plain
    # format needs: the tiny OPT tokenizer has none, and adds no BOS to plain text
    assert model["image"] == images.serve_image()
    template = plain_template(None)
    # named as the runtime names it (the InferenceService), and by the version's model URI: the judge's check
    named = ["--served-model-name", "chat", f"models:/{NAME}/1"]
    assert model["args"] == ["--max-model-len=512", *named, "--dtype=float32", f"--chat-template={template}"]
    assert model["env"] == [{"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"}]
    assert "nvidia.com/gpu" not in model["resources"]["requests"]
    assert "networking.kserve.io/visibility" not in body["metadata"]["labels"]
    assert body["metadata"]["name"] == "chat"
    # on GPUs the runtime's own (CUDA) image and dtype; the template still, which the tokenizer lacks
    body = manifest_here(registry, tmp_path, *sets[:2], "serve.gpus=2", "serve.kv_cache_gib=4")
    model = body["spec"]["predictor"]["model"]
    assert "image" not in model and "env" not in model
    assert model["args"] == ["--served-model-name", NAME, f"models:/{NAME}/1", f"--chat-template={template}"]
    assert model["resources"]["limits"]["nvidia.com/gpu"] == "2" and errors(body) == []
    body = manifest_here(registry, tmp_path, *sets[:3], "serve.image=runtime", "serve.cpu_dtype=bfloat16")
    model = body["spec"]["predictor"]["model"]
    assert "image" not in model and model["args"][3] == "--dtype=bfloat16"
    body = manifest_here(registry, tmp_path, *sets[:3], "serve.image=registry.example/vllm-cpu:1")
    assert body["spec"]["predictor"]["model"]["image"] == "registry.example/vllm-cpu:1"
    # tool calling (docs/tools.md): vLLM's parser of the markup the policy writes, after the template
    body = manifest_here(registry, tmp_path, *sets[:3], "serve.tool_call_parser=hermes")
    assert body["spec"]["predictor"]["model"]["args"][-3:] == [
        f"--chat-template={template}",
        "--enable-auto-tool-choice",
        "--tool-call-parser=hermes",
    ]


def test_what_cannot_be_served_is_one_line(registry: MlflowServer, tmp_path: Path) -> None:
    base = ["serve", "--tracking-uri", registry.url, "--manifest", tmp_path / "x.yaml"]
    done, _ = kubealign(registry.url, *base, "--model", NAME, "--alias", "nope")
    assert f"registered model '{NAME}' has no alias 'nope'" in one_line_error(done)
    done, _ = kubealign(registry.url, *base, "--model", "no-such-model")
    assert "has no alias 'champion'" in one_line_error(done)
    done, _ = kubealign(registry.url, *base, "--model", NAME)  # a server serving artifacts, no destination
    assert "serve.artifacts_destination" in one_line_error(done)
    assert not (tmp_path / "x.yaml").exists()


def test_a_registered_directory_without_a_tokenizer_is_refused(registry: MlflowServer, tmp_path: Path) -> None:
    """The tokenizer of the registered version moved away on the server's disk (and back afterwards)."""
    model_dir = next((registry.root / "artifacts").rglob("model/artifacts/*/config.json")).parent
    aside = tmp_path / "aside"
    aside.mkdir()
    moved = [p for p in model_dir.iterdir() if p.name.startswith(("tokenizer", "vocab", "merges", "special"))]
    assert moved
    for path in moved:
        path.rename(aside / path.name)
    try:
        args = [
            "serve",
            "--tracking-uri",
            registry.url,
            "--model",
            NAME,
            "--set",
            f"serve.artifacts_destination={DESTINATION}",
            "--manifest",
            tmp_path / "x.yaml",
        ]
        done, _ = kubealign(registry.url, *args)
        line = one_line_error(done)
        assert "is not a servable model directory: a tokenizer" in line and "version 1" in line, line
    finally:
        for path in moved:
            (aside / path.name).rename(path)


def test_names_become_dns_labels() -> None:
    assert dns_name("kubealign-actor") == "kubealign-actor"
    digest = hashlib.sha256(b"My_Model.v2").hexdigest()[:8]
    assert dns_name("My_Model.v2") == f"my-model-v2-{digest}"
    assert dns_name("7b-chat").startswith("m-7b-chat-")
    long = dns_name("a" * 60)
    assert len(long) <= 45 and long != dns_name("a" * 61)


def test_two_registries_version_1_are_two_cached_copies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The download cache of `kubealign serve` / `feedback push`: the same name and version from two registries
    (their files elsewhere) are two copies, each with its own files; the same one again is the copy made."""
    from kubealign.serving.local import download

    monkeypatch.setenv("KUBEALIGN_CACHE_DIR", str(tmp_path / "cache"))
    made = []
    for n in (1, 2):
        files = tmp_path / f"registry{n}" / "model"
        files.mkdir(parents=True)
        (files / "config.json").write_text(json.dumps({"registry": n}))
        made.append(Served("kubealign-tiny", "1", "champion", f"run{n}", str(files)))
    first, second = (download(served, "sqlite:///unused.db") for served in made)
    assert first != second
    assert [json.loads((d / "config.json").read_text())["registry"] for d in (first, second)] == [1, 2]
    (Path(made[0].model_dir_uri) / "config.json").write_text("{}")  # the source changes after the download
    assert download(made[0], "sqlite:///unused.db") == first  # downloaded once: the cached copy is used
    assert json.loads((first / "config.json").read_text()) == {"registry": 1}


def test_storage_uris() -> None:
    s3 = "s3://bucket/mlflow"
    assert (
        storage_uri("mlflow-artifacts:/3/abc/artifacts/model/artifacts/d", s3)
        == f"{s3}/3/abc/artifacts/model/artifacts/d"
    )
    assert storage_uri("mlflow-artifacts://mlflow:5000/3/abc/x", s3 + "/") == f"{s3}/3/abc/x"
    # one slash between destination and path, whichever side brings it
    assert storage_uri("mlflow-artifacts:/3/abc/x", s3 + "/") == f"{s3}/3/abc/x"
    assert storage_uri("mlflow-artifacts://mlflow:5000/3/abc/x", s3) == f"{s3}/3/abc/x"
    assert storage_uri("s3://elsewhere/x", None) == "s3://elsewhere/x"
    with pytest.raises(UserError, match="KServe cannot read"):
        storage_uri("file:///srv/mlartifacts/1/x", s3)
    assert missing_files(["config.json", "model.safetensors", "tokenizer.json"]) == []
    assert missing_files(["config.json", "tokenizer_config.json"]) == ["weights (*.safetensors)"]


def test_each_serve_runtime_is_one_row_that_the_manifest_follows(monkeypatch: pytest.MonkeyPatch) -> None:
    """serve.runtime's names are the table's rows, and a row alone decides the predictor: a stand-in row (an
    OpenAI server with its own CPU image) under the huggingface name changes format, runtime, image and args."""
    from typing import get_args

    from kubealign.serving import runtimes

    assert set(get_args(ServeConfig.model_fields["runtime"].annotation)) == set(runtimes.RUNTIMES)
    served = Served(NAME, "3", "champion", "run1", "mlflow-artifacts:/1/run1/artifacts/model/artifacts/actor")
    cpu = ServeConfig(gpus=0)
    plain = inference_service(served, "s3://b/1/model", cpu, "team-a", chat_template="T")["spec"]["predictor"]
    assert plain["model"]["modelFormat"] == {"name": "huggingface"}
    assert plain["model"]["runtime"] == "kserve-huggingfaceserver"
    assert "image" not in plain["model"] and "args" not in plain["model"]  # the template only for an OpenAI server
    row = runtimes.Runtime("other", "kserve-other", openai_server=True, cpu_image=lambda: "example.org/other:1")
    monkeypatch.setitem(runtimes.RUNTIMES, "huggingface", row)
    model = inference_service(served, "s3://b/1/model", cpu, "team-a", chat_template="T")["spec"]["predictor"]["model"]
    assert model["modelFormat"] == {"name": "other"} and model["runtime"] == "kserve-other"
    assert model["image"] == "example.org/other:1"
    assert model["args"] == [
        "--served-model-name",
        NAME,
        f"models:/{NAME}/3",
        "--dtype=float32",
        "--chat-template=T",
    ]
    # with GPUs the runtime keeps its own image
    on_gpu = inference_service(served, "s3://b/1/model", ServeConfig(), "team-a")["spec"]["predictor"]["model"]
    assert "image" not in on_gpu and "--dtype=float32" not in on_gpu["args"]


def body(storage: str = "s3://b/1/model") -> dict:
    served = Served(NAME, "3", "champion", "run1", "mlflow-artifacts:/1/run1/artifacts/model/artifacts/actor")
    return inference_service(served, storage, ServeConfig(), "team-a")


@pytest.fixture
def kube():
    standin = StandInKube(ready_after=2)
    yield standin
    standin.stop()


def test_apply_creates_then_changes_nothing_then_updates(kube: StandInKube) -> None:
    api = kube.client()
    assert deploy.apply(api, body()) == "created"
    ready = deploy.wait_ready(api, NAME, "team-a", timeout_s=60, poll_s=0)
    assert ready["status"]["conditions"][0]["status"] == "True"
    assert deploy.apply(api, body()) == "unchanged"  # a rerun of the task
    assert kube.calls("PATCH") == [] and len(kube.calls("POST")) == 1
    assert deploy.apply(api, body("s3://b/2/model")) == "updated"
    [(_, _, patch)] = kube.calls("PATCH")
    assert patch["metadata"]["resourceVersion"] == ready["metadata"]["resourceVersion"]
    stored = kube.objects[("team-a", NAME)]
    assert stored["spec"]["predictor"]["model"]["storageUri"] == "s3://b/2/model"
    assert stored["metadata"]["generation"] == 2
    # Ready of generation 1 does not count for generation 2: two more polls until the controller saw it
    gets = len(kube.calls("GET"))
    deploy.wait_ready(api, NAME, "team-a", timeout_s=60, poll_s=0)
    assert len(kube.calls("GET")) - gets == 3


def test_a_manifest_the_crd_refuses_is_one_line(kube: StandInKube) -> None:
    broken = body()
    broken["spec"]["predictor"]["model"]["storageURI"] = broken["spec"]["predictor"]["model"].pop("storageUri")
    with pytest.raises(UserError, match=r"creating InferenceService team-a/serve-actor: HTTP 422"):
        deploy.apply(kube.client(), broken)


def test_forbidden_and_conflict_are_one_line_each(kube: StandInKube) -> None:
    api = kube.client()
    kube.fail[("POST", 1)] = 403
    with pytest.raises(UserError, match=r"creating InferenceService team-a/serve-actor: HTTP 403 .*Role"):
        deploy.apply(api, body())
    assert deploy.apply(api, body()) == "created"
    kube.fail[("PATCH", 1)] = 409
    with pytest.raises(UserError, match=r"updating InferenceService team-a/serve-actor: HTTP 409 .*rerun"):
        deploy.apply(api, body("s3://b/2/model"))


def test_a_stale_resource_version_is_a_conflict(kube: StandInKube) -> None:
    api = kube.client()
    deploy.apply(api, body())
    real_get = api.get_namespaced_custom_object

    def get_then_someone_writes(*args, **kwargs):
        seen = real_get(*args, **kwargs)
        kube.objects[("team-a", NAME)]["metadata"]["resourceVersion"] = "999"  # another writer, in between
        return seen

    api.get_namespaced_custom_object = get_then_someone_writes
    with pytest.raises(UserError, match="HTTP 409"):
        deploy.apply(api, body("s3://b/2/model"))


def test_not_ready_in_time_is_one_line_with_the_reason() -> None:
    standin = StandInKube(ready_after=None, not_ready_message="RevisionMissing: 0/1 pods ready")
    try:
        api = standin.client()
        deploy.apply(api, body())
        ticks = iter(range(100))
        with pytest.raises(UserError, match=r"not Ready after 5 s \(serve.ready_timeout_s\): RevisionMissing"):
            deploy.wait_ready(api, NAME, "team-a", timeout_s=5, poll_s=0, clock=lambda: next(ticks))
    finally:
        standin.stop()


def kubeconfig(path: Path, url: str) -> Path:
    """A kubeconfig whose cluster is the stand-in: what `kubectl` or a developer's machine would have."""
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "standin",
        "clusters": [{"name": "standin", "cluster": {"server": url}}],
        "users": [{"name": "pipeline", "user": {"token": "t"}}],
        "contexts": [{"name": "standin", "context": {"cluster": "standin", "user": "pipeline"}}],
    }
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


SERVE_TASK = """
import json, sys
from kubealign import tasks
print("RESULT " + json.dumps(tasks.serve(sys.argv[1], [], sys.argv[2], sys.argv[3])))
"""


def test_the_serve_task_applies_what_promote_moved(registry: MlflowServer, kube: StandInKube, tmp_path: Path) -> None:
    """The task as the DAG runs it (its own process, the cluster from the environment: here a kubeconfig),
    on the promote output that made version 1 champion."""
    import json
    import subprocess
    import sys

    from kubealign.config import config_to_json, load_config
    from tests.support.stores import process_env

    config = load_config(
        None,
        [f"promote.registered_model={NAME}", f"serve.artifacts_destination={DESTINATION}", "serve.ready_timeout_s=60"],
    )
    env = process_env(
        {
            "MLFLOW_TRACKING_URI": registry.url,
            "KUBECONFIG": str(kubeconfig(tmp_path / "kc", kube.url)),
            "KUBEALIGN_POD_NAMESPACE": "team-a",
            "KUBEALIGN_RUN_ID": "run-42",
        }
    )
    out = tmp_path / "serving"
    argv = [sys.executable, "-c", SERVE_TASK, config_to_json(config), str(registry.root / "p0"), str(out)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT ", 1)[1])
    assert result["applied"] and result["action"] == "created" and result["version"] == "1"
    assert result["url"] == f"http://{NAME}.team-a.svc.cluster.local"
    [(_, path, created)] = kube.calls("POST")
    assert path == "/apis/serving.kserve.io/v1beta1/namespaces/team-a/inferenceservices"
    assert created["metadata"]["annotations"]["kubealign.io/pipeline-run"] == "run-42"
    assert created["spec"]["predictor"]["model"]["storageUri"].startswith(f"{DESTINATION}/")
    assert yaml.safe_load((out / "inferenceservice.yaml").read_text(encoding="utf-8")) == created
    assert "Ready at" in done.stdout


def test_the_serve_task_refuses_a_flipped_byte_and_applies_nothing(
    registry: MlflowServer, kube: StandInKube, tmp_path: Path
) -> None:
    import subprocess
    import sys

    from kubealign.config import config_to_json, load_config
    from tests.support.stores import process_env

    config = load_config(None, [f"promote.registered_model={NAME}", f"serve.artifacts_destination={DESTINATION}"])
    env = {"MLFLOW_TRACKING_URI": registry.url, "KUBECONFIG": str(kubeconfig(tmp_path / "kc", kube.url))}
    env["KUBEALIGN_POD_NAMESPACE"] = "team-a"
    out = tmp_path / "serving"
    argv = [sys.executable, "-c", SERVE_TASK, config_to_json(config), str(registry.root / "p0"), str(out)]
    with flipped_byte(registry):
        done = subprocess.run(argv, env=process_env(env), capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert f"serve: {NAME} version 1: model.safetensors has sha256 " in done.stderr, done.stderr[-2000:]
    assert kube.calls("POST") == [] and kube.calls("PUT") == [] and not out.exists()


def test_nothing_is_applied_when_promote_did_not_move_the_alias(kube: StandInKube, tmp_path: Path) -> None:
    import json

    from kubealign.cli.summary import _headline
    from kubealign.config import load_config
    from kubealign.stages import serve as stage

    promotion = tmp_path / "promote"
    promotion.mkdir()
    same = {"challenger": 2, "champion": 1, "previous-champion": None}
    result = {
        "stage": "promote",
        "registered_model": NAME,
        "aliases": same,
        "aliases_before": {**same, "challenger": 1},
    }
    (promotion / "result.json").write_text(json.dumps(result), encoding="utf-8")
    done = stage.run(load_config(None, []), promotion, tmp_path / "serving", custom=kube.client())
    assert done["applied"] is False and "did not move champion (version 1)" in done["why"]
    assert kube.requests == []  # not even a read: the cluster is left alone
    assert "did not move champion" in _headline("serve", done)
    # an alias promote does not manage (a person's `staging`) is applied: promote cannot tell whether it moved
    assert stage.moved(result, "staging") == (True, None)
    assert stage.moved({**result, "aliases_before": {**same, "champion": None}}, "champion") == (True, 1)


PROMPTS = [
    "\n\nHuman: hello there\n\nAssistant:",
    "\n\nHuman: What is 2+2?\n\nAssistant: 4.\n\nHuman: And 3+3?\n\nAssistant:",
    "\n\nSystem: be brief\n\nHuman: hi\n\nAssistant:",
]


@pytest.mark.parametrize("arch", ["opt", "llama"])
def test_the_plain_chat_template_renders_what_training_encoded(arch: str, tmp_path: Path) -> None:
    """Messages through the served template equal the plain prompt as training encoded it (encode_prompt),
    token for token: the template is tokenize.plain_to_messages reversed, with the tokenizer's BOS."""
    from transformers import AutoTokenizer

    from kubealign.data.tokenize import encode_prompt, plain_to_messages
    from kubealign.models import loading
    from kubealign.serving.local import chat_template

    model = tmp_path / "model"
    model.symlink_to(loading.resolve(f"tiny-{arch}"))
    tokenizer = AutoTokenizer.from_pretrained(model)
    template = chat_template(model)
    assert template is not None  # the tiny tokenizers have none: training used the plain format
    tokenizer.chat_template = template.read_text(encoding="utf-8")
    for prompt in PROMPTS:
        text = tokenizer.apply_chat_template(plain_to_messages(prompt), tokenize=False, add_generation_prompt=True)
        served = tokenizer(text, add_special_tokens=False)["input_ids"]  # vLLM's chat path adds none
        assert served == encode_prompt(AutoTokenizer.from_pretrained(model), prompt), (arch, prompt)


def test_serving_here_refuses_in_one_line(registry: MlflowServer, tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done, _ = kubealign(registry.url, "serve", "--model", NAME, "--port", port)
        assert f"--port {port}: 127.0.0.1:{port} is in use" in one_line_error(done)
    done, _ = kubealign(registry.url, "serve", "--model", NAME, "--alias", "gone", "--port", port)
    assert "has no alias 'gone'" in one_line_error(done)


def test_a_broken_weights_file_is_refused_before_serving(tmp_path: Path) -> None:
    import shutil

    from kubealign.models import loading
    from kubealign.serving.local import check_dir

    model = tmp_path / "model"
    shutil.copytree(loading.resolve("tiny-opt"), model)
    check_dir(model)  # whole: no error
    (model / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(UserError, match=r"model.safetensors: not a readable safetensors file"):
        check_dir(model)
    (model / "model.safetensors").unlink()
    with pytest.raises(UserError, match=r"is not a servable model directory: weights \(\*.safetensors\)"):
        check_dir(model)


def test_the_plain_template_carries_the_bos_a_tokenizer_adds() -> None:
    import jinja2

    from kubealign.data.tokenize import plain_to_messages

    for bos, start in (("<s>", "<s>"), (None, "")):
        template = jinja2.Environment().from_string(plain_template(bos))
        for prompt in PROMPTS:
            rendered = template.render(messages=plain_to_messages(prompt), add_generation_prompt=True, bos_token="<s>")
            assert rendered == start + prompt


CANARY_NAME = "canary-actor"


@pytest.fixture(scope="module")
def canary_registry(registry: MlflowServer, tmp_path_factory: pytest.TempPathFactory) -> tuple[MlflowServer, Path]:
    """CANARY_NAME promoted twice with promote.mode canary: version 1 (tiny-opt) champion, then version 2 (another
    directory, tiny-llama, a better evaluation) challenger only; (the server, the second promote's output)."""
    from kubealign.models import loading
    from tests.faults.test_faults_registry import aliases

    root = tmp_path_factory.mktemp("canary")
    for i, (model, reward) in enumerate((("tiny-opt", 1.0), ("tiny-llama", 1.2))):
        argv = [
            "promote",
            "--evaluation",
            evaluation(root, f"e{i}", win=0.8, gain=0.4, reward=reward),
            "--model-dir",
            loading.resolve(model),
            "--output",
            root / f"p{i}",
            "--set",
            f"promote.registered_model={CANARY_NAME}",
            "--set",
            "promote.mode=canary",
        ]
        done, _ = kubealign(registry.url, *argv)
        assert done.returncode == 0, done.stderr[-3000:]
    assert aliases(registry.url, CANARY_NAME) == {"champion": "1", "challenger": "2"}
    return registry, root / "p1"


def in_process(*argv: object) -> tuple[int, str]:
    """`kubealign ARGV` in this process (for refusals before any registry call): (exit code, stderr)."""
    import contextlib
    import io

    from kubealign.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, err.getvalue()


def test_a_canary_alias_is_served_beside_the_champion(canary_registry, tmp_path: Path) -> None:
    """Version 2 (another directory) holds `challenger`: --canary makes it the InferenceService's canary with
    its own storage URI and its share of the traffic; valid for KServe v0.20."""
    from kubealign.models import loading

    registry, _ = canary_registry
    sets = [
        f"promote.registered_model={CANARY_NAME}",
        f"serve.artifacts_destination={DESTINATION}",
        "serve.gpus=0",
        "serve.runtime=vllm",
    ]
    args = [
        "serve",
        "--tracking-uri",
        registry.url,
        "--manifest",
        tmp_path / "isvc.yaml",
        "--canary",
        "challenger",
        "--canary-percent",
        "25",
        *[a for s in sets for a in ("--set", s)],
    ]
    done, _ = kubealign(registry.url, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "canary canary-actor@challenger = version 2, 25 % of the traffic" in done.stdout
    body = yaml.safe_load((tmp_path / "isvc.yaml").read_text(encoding="utf-8"))
    assert errors(body) == []
    stable, [canary] = body["spec"]["predictor"], body["spec"]["canary"]
    assert canary["trafficPercent"] == 25 and "canaryTrafficPercent" not in stable
    ours, theirs = stable["model"]["storageUri"], canary["predictor"]["model"]["storageUri"]
    annotations = body["metadata"]["annotations"]
    assert ours == annotations["kubealign.io/storage-uri"] and theirs == annotations["kubealign.io/canary-storage-uri"]
    assert ours != theirs and theirs.startswith(f"{DESTINATION}/")
    on_disk = registry.root / "artifacts" / theirs.removeprefix(f"{DESTINATION}/")
    llama = Path(loading.resolve("tiny-llama"))
    assert (on_disk / "config.json").read_bytes() == (llama / "config.json").read_bytes()  # version 2's files
    assert annotations["kubealign.io/model-version"] == "1" and annotations["kubealign.io/canary-model-version"] == "2"
    assert annotations["kubealign.io/canary-alias"] == "challenger"
    assert annotations["kubealign.io/canary-traffic-percent"] == "25"
    assert body["metadata"]["labels"]["kubealign.io/canary-alias"] == "challenger"
    # the canary's predictor is the one its alias alone would get (image, args, resources)
    alone = manifest(registry, tmp_path, *sets, alias="challenger")
    assert canary["predictor"]["model"].pop("name") == "kserve-container"  # the CRD requires the container's name
    # each predictor's pods say which they are (kubealign.serving.endpoints: the judge asks each alone)
    assert body["spec"]["predictor"]["labels"] == {
        "kubealign.io/inference-service": CANARY_NAME,
        "kubealign.io/predictor": "stable",
        "kubealign.io/model-version": "1",
    }
    assert canary["predictor"]["labels"] == {**alone["spec"]["predictor"]["labels"], "kubealign.io/predictor": "canary"}
    assert alone["spec"]["predictor"]["labels"]["kubealign.io/model-version"] == "2"
    canary["predictor"]["labels"]["kubealign.io/predictor"] = "stable"
    assert canary["predictor"] == alone["spec"]["predictor"]
    # refused in one line, nothing written
    done, _ = kubealign(registry.url, *args[:6], "nope", *args[7:])
    assert "has no alias 'nope'" in one_line_error(done)
    base = ["serve", "--tracking-uri", registry.url, "--manifest", tmp_path / "no.yaml"]
    for extra, said in (
        (["--canary", "champion"], "that is the alias served"),
        (["--canary", "challenger", "--canary-percent", "100"], "a share from 1 to 99"),
        (["--canary-percent", "5"], "give --canary ALIAS"),
    ):
        code, err = in_process(*base, *extra)
        assert code == 2 and said in err and err.count("\n") == 1, extra
    assert not (tmp_path / "no.yaml").exists()


def test_in_canary_mode_the_serve_task_serves_the_new_challenger_as_the_canary(
    canary_registry, kube: StandInKube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import functools

    from kubealign.config import load_config
    from kubealign.stages import serve as stage

    fast = functools.partial(deploy.wait_ready, poll_s=0)  # the stand-in is Ready at the second poll
    monkeypatch.setattr(deploy, "wait_ready", fast)

    registry, promotion = canary_registry
    sets = [
        f"promote.registered_model={CANARY_NAME}",
        f"serve.artifacts_destination={DESTINATION}",
        "serve.namespace=team-a",
        f"tracking.uri={registry.url}",
    ]
    config = load_config(None, [*sets, "promote.mode=canary", "serve.ready_timeout_s=60", "canary.percent=20"])
    done = stage.run(config, promotion, tmp_path / "serving", custom=kube.client())
    assert done["applied"] and done["version"] == "1"  # champion stays what is served to most
    assert done["canary"] == {"alias": "challenger", "version": "2", "percent": 20}
    [(_, _, created)] = kube.calls("POST")
    assert errors(created) == [] and created["spec"]["canary"][0]["trafficPercent"] == 20
    canary = created["spec"]["canary"][0]["predictor"]["model"]
    assert canary["storageUri"] != created["spec"]["predictor"]["model"]["storageUri"]
    # the same promote output in direct mode: champion did not move, nothing is applied
    assert (
        stage.run(load_config(None, sets), promotion, tmp_path / "serving2", custom=kube.client())["applied"] is False
    )


def test_the_verdict_is_carried_out_in_the_registry_then_in_serving_and_a_rerun_finishes_it(
    registry: MlflowServer,
    kube: StandInKube,
    split_dir: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A canary that answers worse, judged by the pipeline's judge task through each predictor's pods: its
    verdict written and nothing moved; the act task then rolls it back: challenger cleared and tagged, the canary
    removed from the service, champion and its files unchanged. A promoted one whose service update fails halfway
    (a crash between the registry and the cluster): the registry is decided, the act task run again moves no
    alias and finishes the service."""
    import functools

    from mlflow.tracking import MlflowClient

    from kubealign.config import load_config
    from kubealign.models import loading
    from kubealign.serving import carry_out
    from kubealign.stages import act as act_task
    from kubealign.stages import judge_task
    from kubealign.stages import serve as stage
    from tests.faults.test_faults_registry import aliases
    from tests.stages.test_judge import Completions, judge_config, listing

    monkeypatch.setattr(deploy, "wait_ready", functools.partial(deploy.wait_ready, poll_s=0))
    name = "act-actor"
    sets = [
        f"promote.registered_model={name}",
        "promote.mode=canary",
        f"serve.artifacts_destination={DESTINATION}",
        "serve.namespace=team-a",
        f"tracking.uri={registry.url}",
    ]
    config = load_config(None, sets)

    def promote_canary(i: int, model: str, reward: float) -> Path:
        argv = [
            "promote",
            "--evaluation",
            evaluation(tmp_path, f"e{i}", win=0.8, gain=0.4, reward=reward),
            "--model-dir",
            loading.resolve(model),
            "--output",
            tmp_path / f"p{i}",
            *[a for s in sets[:2] for a in ("--set", s)],
        ]
        done, _ = kubealign(registry.url, *argv)
        assert done.returncode == 0, done.stderr[-3000:]
        stage.run(config, tmp_path / f"p{i}", tmp_path / f"s{i}", custom=kube.client())  # served as the canary
        return tmp_path / f"p{i}"

    def served() -> dict:
        return kube.objects[("team-a", name)]

    promote_canary(0, "tiny-opt", 1.0)
    # curt but not degenerate: the promotion guards bound the length ratio (issue 53)
    courteous, curt = Completions(lambda p: " Certainly! Here it is."), Completions(lambda p: " No, I cannot help.")
    kube.ports = {"stable": courteous.port, "canary": curt.port}  # the pods of each predictor: these servers
    courteous.models, curt.models = listing(name, "1", first=name), listing(name, "2", first=name)  # vllm runtime's
    judged = load_config(judge_config(tmp_path), [*sets, "tracking.enabled=true", "canary.min_answers=3"])
    judge = functools.partial(judge_task.run, judged, split_dir, loading.resolve("tiny-opt"), None, core=kube.core())
    act_on = functools.partial(act_task.run, judged, custom=kube.client())
    assert judge(tmp_path / "s0", tmp_path / "j0")["why"] == "serve applied no canary: nothing to judge"
    nothing = act_on(tmp_path / "j0", tmp_path / "a0")
    assert not nothing["acted"] and nothing["why"] == "nothing to carry out: serve applied no canary: nothing to judge"
    promote_canary(1, "tiny-llama", 1.2)
    assert aliases(registry.url, name) == {"champion": "1", "challenger": "2"} and "canary" in served()["spec"]
    stable = served()["spec"]["predictor"]["model"]["storageUri"]
    # the judge task: the canary's pods answer curtly, the champion's courteously: its verdict, a roll-back
    try:
        result = judge(tmp_path / "s1", tmp_path / "j1")
    finally:
        courteous.stop()
        curt.stop()
    assert not result["promoted"] and result["metrics"]["win_rate"] == 0.0 and result["metrics"]["prompts"] == 6
    assert result["versions"] == {"champion": "1", "canary": "2"}  # what feedback push --from-judge names
    verdict = json.loads((tmp_path / "j1" / judge_task.VERDICT_FILE).read_text())
    assert verdict == {
        "judged": True,
        "promoted": False,
        "awaiting_people": False,  # canary.await_people unset: the verdict is final
        "version": "2",
        "registered_model": name,
        "inference_service": f"team-a/{name}",
        "verdict": result["verdict"],
    }
    # the judge (user code, the tracking identity) moved nothing: the registry and the service are as they were
    assert aliases(registry.url, name) == {"champion": "1", "challenger": "2"} and "canary" in served()["spec"]
    # the act task carries it out
    acted = act_on(tmp_path / "j1", tmp_path / "a1")
    assert acted["registry"] == {"challenger": None, "champion": "1", "previous-champion": None}
    assert (acted["inference_service"], acted["action"]) == (f"team-a/{name}", "updated")
    assert MlflowClient(registry.url).get_model_version(name, "2").tags[carry_out.REJECTED_TAG] == "rejected"
    assert "canary" not in served()["spec"] and served()["spec"]["predictor"]["model"]["storageUri"] == stable
    assert errors(served()) == []
    again = act_on(tmp_path / "j1", tmp_path / "a1")  # a rerun of act: nothing moves, nothing changes
    assert again["registry"]["champion"] == "1" and again["action"] == "unchanged"
    # promoted (a verdict on version 3), the service update failing once
    promote_canary(2, "tiny-llama", 1.3)
    assert aliases(registry.url, name) == {"champion": "1", "challenger": "3"} and "canary" in served()["spec"]
    canary_files = served()["spec"]["canary"][0]["predictor"]["model"]["storageUri"]
    (tmp_path / "j2").mkdir()
    (tmp_path / "j2" / judge_task.VERDICT_FILE).write_text(json.dumps({**verdict, "promoted": True, "version": "3"}))
    kube.fail[("PATCH", len(kube.calls("PATCH")) + 1)] = 500
    with pytest.raises(UserError, match=f"updating InferenceService team-a/{name}: HTTP 500"):
        act_on(tmp_path / "j2", tmp_path / "a2")
    assert aliases(registry.url, name) == {"champion": "3", "previous-champion": "1"}  # decided in the registry
    assert "canary" in served()["spec"] and not (tmp_path / "a2").exists()  # still split in the cluster
    assert carry_out.served_canary(kube.client(), "team-a", name) == "3"  # what a rerun of the judge judges
    finished = act_on(tmp_path / "j2", tmp_path / "a2")  # the rerun of act: moves nothing, finishes the service
    assert finished["registry"] == {"challenger": None, "champion": "3", "previous-champion": "1"}
    assert aliases(registry.url, name) == {"champion": "3", "previous-champion": "1"}
    assert finished["action"] == "updated" and carry_out.served_canary(kube.client(), "team-a", name) is None
    assert "canary" not in served()["spec"] and served()["spec"]["predictor"]["model"]["storageUri"] == canary_files
    assert carry_out.served_canary(kube.client(), "team-b", name) is None  # no such service
    # a verdict about a version that is not challenger any more is refused
    with pytest.raises(UserError, match="challenger is now version None, not the judged version 2: judge again"):
        carry_out.in_registry(config, registry.url, True, "2")
    # `kubealign rollback --namespace`: the previous champion again, in the registry and in what is served
    from kubealign.cluster import trainjob

    monkeypatch.setattr(trainjob, "connect", lambda: (kube.client(), None))  # the cluster: the stand-in
    monkeypatch.setenv("MLFLOW_TRACKING_URI", registry.url)
    code, err = in_process("rollback", *[a for s in sets for a in ("--set", s)], "--namespace", "team-a")
    assert code == 0, err
    assert aliases(registry.url, name) == {"champion": "1"}
    assert served()["spec"]["predictor"]["model"]["storageUri"] == stable and "canary" not in served()["spec"]


def test_the_alias_plan_of_a_verdict() -> None:
    from kubealign.promotion.aliases import verdict_plan as alias_plan

    state = {"champion": "1", "challenger": "2"}
    assert alias_plan(True, "2", state) == [("previous-champion", "1"), ("champion", "2"), ("challenger", None)]
    assert alias_plan(False, "2", state) == [("challenger", None)]
    assert alias_plan(True, "2", {"challenger": "2"}) == [("champion", "2"), ("challenger", None)]
    assert alias_plan(True, "2", {"champion": "2", "previous-champion": "1"}) == []  # done before a crash
    assert alias_plan(False, "2", {"champion": "1"}) == []
    assert alias_plan(True, "2", {"champion": "1", "challenger": "3"}) is None  # another promotion since
    assert alias_plan(False, "2", {"champion": "1", "challenger": "3"}) is None
    assert alias_plan(True, "2", {"champion": "1"}) is None


def test_no_cluster_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kubernetes.config import kube_config

    from kubealign.cluster.trainjob import connect

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "no-kubeconfig"))
    with pytest.raises(UserError, match="no Kubernetes cluster: not in a pod, and no usable kubeconfig"):
        connect()
    code, err = in_process("rollback", "--namespace", "team-a", "--set", "tracking.uri=http://127.0.0.1:9")
    assert code == 2 and err.count("\n") == 1  # the registry is asked first: one line either way


@pytest.mark.unit
def test_the_local_vllm_command_gets_the_same_tool_calling_flags():
    from kubealign.serving.local import command

    served = Served(NAME, "3", "champion", "run1", "mlflow-artifacts:/1/run1/artifacts/model/artifacts/actor")
    plain = command(Path("py"), Path("m"), served, 8000, ServeConfig(), None)
    assert "--enable-auto-tool-choice" not in plain
    argv = command(Path("py"), Path("m"), served, 8000, ServeConfig(tool_call_parser="hermes"), Path("t.jinja"))
    assert argv[-5:] == ["--chat-template", "t.jinja", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
