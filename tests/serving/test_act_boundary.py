"""The act task against a verdict written to hurt (the judge task runs user code, so its verdict.json is whatever
that code wrote): the InferenceService it touches is the run's own, and no version is tagged rejected unless
this very call took `challenger` away from it.

The registry is sqlite (no server); each version's source is a local directory holding an MLmodel and an HF
directory listing, its files mapped to a pvc:// URI as a server's --artifacts-destination would; the cluster is
tests/support/kube_standin.py.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import yaml

from kubealign.errors import UserError
from kubealign.provenance.digests import combined_sha256, file_digests
from kubealign.provenance.manifest import MANIFEST_FILE
from kubealign.serving import deploy, location
from kubealign.stages import act as act_task
from kubealign.stages.judge_task import VERDICT_FILE
from tests.support.kube_standin import StandInKube

pytestmark = pytest.mark.faults

NAME = "act-guarded"


@pytest.fixture
def kube():
    standin = StandInKube(ready_after=2)
    yield standin
    standin.stop()


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """(registry URI, the registry client, a function making the act task's config from --set lines)."""
    from mlflow.tracking import MlflowClient

    from kubealign.config import load_config

    source = tmp_path / "logged"
    (source / "model_dir").mkdir(parents=True)
    mlmodel = {"flavors": {"python_function": {"artifacts": {"model_dir": {"path": "model_dir"}}}}}
    (source / "MLmodel").write_text(yaml.safe_dump(mlmodel), encoding="utf-8")
    for file in ("config.json", "model.safetensors", "tokenizer.json"):
        (source / "model_dir" / file).write_text("{}", encoding="utf-8")
    files = file_digests(source / "model_dir")  # the provenance manifest promote writes: act checks the files
    recorded = {"files": files, "model_sha256": combined_sha256(files)}
    (source / MANIFEST_FILE).write_text(json.dumps(recorded), encoding="utf-8")
    monkeypatch.setattr(location, "storage_uri", lambda uri, _: f"pvc://claim/{Path(uri).name}")
    monkeypatch.setattr(deploy, "wait_ready", functools.partial(deploy.wait_ready, poll_s=0))
    monkeypatch.delenv("KUBEALIGN_POD_NAMESPACE", raising=False)
    uri = f"sqlite:///{tmp_path / 'registry.db'}"
    client = MlflowClient(uri)
    client.create_registered_model(NAME)
    for _ in range(3):
        client.create_model_version(NAME, source=str(source))

    def config(*sets: str):
        base = [f"promote.registered_model={NAME}", "promote.mode=canary", f"tracking.uri={uri}", "serve.gpus=0"]
        return load_config(None, [*base, *sets])

    return uri, client, config


def verdict(tmp_path: Path, label: str, promoted: bool, version: str, service: str) -> Path:
    judged = tmp_path / label
    judged.mkdir()
    body = {"judged": True, "promoted": promoted, "version": version, "registered_model": NAME}
    body.update(inference_service=service, verdict=f"judge: challenger (version {version}) ...")
    (judged / VERDICT_FILE).write_text(json.dumps(body), encoding="utf-8")
    return judged


def aliases(client) -> dict[str, str]:
    return {a: str(v) for a, v in client.get_registered_model(NAME).aliases.items()}


def rejected(client) -> list[str]:
    return [str(v.version) for v in client.search_model_versions(f"name='{NAME}'") if "kubealign.online" in v.tags]


def test_a_verdict_cannot_send_act_to_another_namespace_or_service(
    setup, kube: StandInKube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri, client, config = setup
    client.set_registered_model_alias(NAME, "champion", "1")
    client.set_registered_model_alias(NAME, "challenger", "2")
    team_a = config("serve.namespace=team-a")
    for label, service in (
        ("ns", "kube-system/anything"),
        ("other", "team-a/anything"),
        ("ns2", f"kube-system/{NAME}"),
    ):
        judged = verdict(tmp_path, label, False, "2", service)
        with pytest.raises(UserError) as refused:
            act_task.run(team_a, judged, tmp_path / f"out-{label}", custom=kube.client())
        assert str(refused.value) == (
            f"{judged / VERDICT_FILE}: the verdict is about InferenceService {service}, but this run serves "
            f"team-a/{NAME} (serve.namespace, serve.name): nothing was carried out"
        )
        assert aliases(client) == {"champion": "1", "challenger": "2"} and rejected(client) == []
        assert kube.requests == [] and not (tmp_path / f"out-{label}").exists()
    # serve.namespace unset: the pod's own namespace, as the serve task takes it
    monkeypatch.setenv("KUBEALIGN_POD_NAMESPACE", "team-b")
    judged = verdict(tmp_path, "pod", False, "2", f"team-a/{NAME}")
    with pytest.raises(UserError, match=f"but this run serves team-b/{NAME} "):
        act_task.run(config(), judged, tmp_path / "out-pod", custom=kube.client())
    assert aliases(client) == {"champion": "1", "challenger": "2"} and kube.requests == []
    # the run's own service: carried out there
    done = act_task.run(team_a, verdict(tmp_path, "own", False, "2", f"team-a/{NAME}"), tmp_path / "a", kube.client())
    assert done["acted"] and done["inference_service"] == f"team-a/{NAME}" and done["action"] == "created"
    assert list(kube.objects) == [("team-a", NAME)] and aliases(client) == {"champion": "1"}
    assert rejected(client) == ["2"]


def test_a_rolled_back_verdict_tags_only_the_version_it_took_challenger_from(
    setup, kube: StandInKube, tmp_path: Path
) -> None:
    uri, client, config = setup
    cfg = config("serve.namespace=team-a")
    service = f"team-a/{NAME}"
    # no challenger: a forged roll-back of the previous champion moves nothing and tags nothing
    client.set_registered_model_alias(NAME, "champion", "2")
    client.set_registered_model_alias(NAME, "previous-champion", "1")
    done = act_task.run(cfg, verdict(tmp_path, "forged", False, "1", service), tmp_path / "a1", kube.client())
    assert done["registry"] == {"challenger": None, "champion": "2", "previous-champion": "1"}
    assert rejected(client) == []
    # a real roll-back of version 3 tags it; a rerun of it and a forged one about version 1 tag nothing else
    client.set_registered_model_alias(NAME, "challenger", "3")
    act_task.run(cfg, verdict(tmp_path, "real", False, "3", service), tmp_path / "a2", kube.client())
    assert aliases(client) == {"champion": "2", "previous-champion": "1"} and rejected(client) == ["3"]
    act_task.run(cfg, verdict(tmp_path, "forged2", False, "1", service), tmp_path / "a3", kube.client())
    act_task.run(cfg, tmp_path / "real", tmp_path / "a4", kube.client())
    assert aliases(client) == {"champion": "2", "previous-champion": "1"} and rejected(client) == ["3"]
