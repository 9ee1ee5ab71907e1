"""Hub models pinned to a commit at compile time (issue 37): a stand-in hub on 127.0.0.1 answers the real
huggingface_hub client; offline, the local cache's refs answer. No network, no real hub."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kubealign.errors import UserError
from kubealign.models import hub
from kubealign.pipelines.fingerprint import model_fingerprint

pytestmark = pytest.mark.unit

V1, V2 = "a1" * 20, "b2" * 20  # as a commit looks (all digits would be a YAML integer in --set)


class StandIn(BaseHTTPRequestHandler):
    """GET /api/models/ORG/NAME/revision/REV -> {"sha": the commit REV names now}."""

    refs: dict[str, str] = {}

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        parts = self.path.split("?")[0].split("/")
        if len(parts) >= 7 and parts[1:3] == ["api", "models"] and parts[5] == "revision":
            sha = self.refs.get(f"{parts[3]}/{parts[4]}@{parts[6]}")
            if sha:
                body = json.dumps({"id": f"{parts[3]}/{parts[4]}", "sha": sha, "siblings": []}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def stand_in():
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    StandIn.refs = {"org/m@main": V1, "org/m@v1": V1}
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


COMPILE = """
import json, sys, yaml
from pathlib import Path
from kubealign.config import load_config
from kubealign.pipelines.remote import compile_pipeline
path = compile_pipeline(load_config(None, ["sft.model=org/m", "sft.revision=v1"]), Path(sys.argv[1]))
params = next(yaml.safe_load_all(path.read_text()))["root"]["inputDefinitions"]["parameters"]
config = json.loads(params["config_json"]["defaultValue"])
print(json.dumps({"revision": config["sft"]["revision"], "fingerprint": params["sft_model_fingerprint"]["defaultValue"]}))
"""


def compile_against(endpoint: str, out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env["HF_ENDPOINT"] = endpoint
    done = subprocess.run(
        [sys.executable, "-c", COMPILE, str(out)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_compiled_pipeline_pins_the_commit_and_a_force_push_changes_the_key(stand_in, tmp_path):
    first = compile_against(stand_in, tmp_path / "a.yaml")
    assert first == {"revision": V1, "fingerprint": f"hub:org/m@{V1}"}  # what the tasks load, the cache key
    StandIn.refs["org/m@v1"] = V2  # the tag force-pushed to another commit
    second = compile_against(stand_in, tmp_path / "b.yaml")
    assert second == {"revision": V2, "fingerprint": f"hub:org/m@{V2}"}


def test_an_unknown_revision_is_one_line_naming_the_field(stand_in):
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env["HF_ENDPOINT"] = stand_in
    code = "from kubealign.models import hub\nhub.commit_of('org/m', 'nope', 'reward.model')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode != 0
    assert "UserError: reward.model org/m@nope: cannot resolve it to a commit (" in done.stderr
    assert "set reward.revision to a commit sha to compile without the hub" in done.stderr


def test_offline_the_local_caches_ref_answers(tmp_path, monkeypatch):
    from huggingface_hub import constants

    assert constants.HF_HUB_OFFLINE  # tests/conftest.py
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    refs = tmp_path / "models--org--m" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text(V2 + "\n")
    assert hub.commit_of("org/m", None, "sft.model") == V2
    with pytest.raises(UserError, match=r"^sft.model org/m@v9: offline \(HF_HUB_OFFLINE\) and not in the local cache"):
        hub.commit_of("org/m", "v9", "sft.model")
    assert hub.commit_of("org/other", V1, "sft.model") == V1  # a commit already: no look-up at all


def test_only_hub_names_are_pinned(tmp_path, monkeypatch):
    from kubealign.config import load_config

    (tmp_path / "local").mkdir()
    assert not hub.is_hub_name("tiny-opt") and not hub.is_hub_name(str(tmp_path / "local"))
    assert not hub.is_hub_name("./missing-dir") and hub.is_hub_name("facebook/opt-1.3b")
    config = load_config(None, [])
    assert hub.pin(config) is config  # tiny models: nothing to pin
    pinned = hub.pin(load_config(None, ["reward.model=org/rm", f"reward.revision={V1}"]))
    assert (pinned.reward.revision, pinned.sft.revision) == (V1, None)
    assert model_fingerprint("org/rm", V1) == f"hub:org/rm@{V1}" and model_fingerprint("org/rm") == "name:org/rm"


def test_the_pinned_commit_reaches_from_pretrained(monkeypatch):
    from transformers import AutoModelForCausalLM

    from kubealign.models import loading

    seen = {}

    def fake(target, **kwargs):
        seen.update(target=target, **kwargs)
        return "model"

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fake)
    assert loading.load_causal_lm("org/m", False, **loading.revision_kw(V1)) == "model"
    assert seen == {"target": "org/m", "trust_remote_code": False, "revision": V1}
    assert loading.revision_kw(None) == {}
