"""Human feedback against a real Label Studio (issue 59; `make test-labelstudio`): two tiny registered models
answer 8 held-out prompts, `kubealign feedback push` sends them as pairwise tasks, two people annotate through
Label Studio's API (one task skipped, one where they disagree), `kubealign feedback pull` maps the choices back
to the two versions, counts what it left out, and reports people's agreement and win-rate; pushing again adds
nothing. The server runs from its own venv (KUBEALIGN_LABEL_STUDIO_VENV, built by the make target) on
127.0.0.1 in a temporary directory."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kubealign.feedback.client import LabelStudio
from tests.faults.test_faults_registry import evaluation, kubealign_env

pytestmark = pytest.mark.labelstudio
VENV_ENV = "KUBEALIGN_LABEL_STUDIO_VENV"
ADMIN_TOKEN = "0123456789abcdef0123456789abcdef01234567"
START_LIMIT_S = 300
# what a fresh server needs before the API takes legacy tokens (Label Studio 1.23 turns them off by default),
# and a second annotator with a token of their own: made in its Django, as its own management shell would
SETUP = """
import pathlib, sys
import label_studio
sys.path.insert(0, str(pathlib.Path(label_studio.__file__).parent))
import django
django.setup()
from jwt_auth.models import JWTSettings
from organizations.models import Organization
from rest_framework.authtoken.models import Token
from users.models import User
JWTSettings.objects.update(legacy_api_tokens_enabled=True)
org = Organization.objects.first()
user = User.objects.create_user(email="second@example.com", password="second-pass-123")
user.active_organization = org
user.save()
if not org.has_user(user):
    org.add_user(user)
print(Token.objects.get_or_create(user=user)[0].key)
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def label_studio(tmp_path_factory):
    venv = Path(os.environ.get(VENV_ENV, ".venv-labelstudio"))
    if not (venv / "bin" / "label-studio").exists():
        pytest.skip(f"no Label Studio venv at {venv} ({VENV_ENV}; `make test-labelstudio` builds one)")
    data = tmp_path_factory.mktemp("label-studio")
    port = free_port()
    env = {
        **os.environ,
        "LABEL_STUDIO_BASE_DATA_DIR": str(data),
        "LABEL_STUDIO_USERNAME": "admin@example.com",
        "LABEL_STUDIO_PASSWORD": "admin-pass-123",
        "LABEL_STUDIO_USER_TOKEN": ADMIN_TOKEN,
        "SENTRY_DSN": "",
    }
    argv = [str(venv / "bin" / "label-studio"), "start", "--internal-host", "127.0.0.1", "--port", str(port)]
    with open(data / "server.log", "wb") as log:
        server = subprocess.Popen([*argv, "--no-browser"], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=data)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_LIMIT_S
        while True:
            assert server.poll() is None, (data / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5):
                    break
            except OSError:
                assert time.monotonic() < deadline, f"Label Studio did not answer in {START_LIMIT_S} s"
                time.sleep(2)
        django = {**env, "DJANGO_SETTINGS_MODULE": "core.settings.label_studio"}
        made = subprocess.run(
            [str(venv / "bin" / "python"), "-c", SETUP], env=django, capture_output=True, text=True, timeout=120
        )
        assert made.returncode == 0, made.stderr[-3000:]
        yield url, made.stdout.strip().splitlines()[-1]
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def kubealign(env: dict[str, str], *args: object) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "kubealign.cli", *map(str, args)]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)


def test_push_annotate_as_two_people_and_pull(label_studio, tmp_path: Path):
    url, second_token = label_studio
    registry = f"sqlite:///{tmp_path / 'registry.db'}"
    env = {**kubealign_env(registry), "LABEL_STUDIO_API_KEY": ADMIN_TOKEN}
    # two registered versions of the tiny model (other weights): 1 becomes previous-champion, 2 champion
    for seed in (0, 1):
        model = tmp_path / f"tiny{seed}"
        assert kubealign(env, "tiny-model", "--arch", "opt", "--seed", seed, "--output", model).returncode == 0
        judged = evaluation(tmp_path, f"e{seed}", win=0.7, gain=0.3, reward=1.0 + seed)
        done = kubealign(
            env, "promote", "--evaluation", judged, "--model-dir", model, "--output", tmp_path / f"p{seed}"
        )
        assert done.returncode == 0, done.stderr[-3000:]
    split = tmp_path / "split"
    small = ["--set", "data.synthetic_pairs=200", "--set", "data.synthetic_sft_rows=10"]  # 8+ held-out prompts
    assert kubealign(env, "data-split", *small, "--output", split).returncode == 0
    push = ["feedback", "push", "--project", "prefs", "--prompts", split, "-n", 8, "--url", url]
    push += ["--first", "previous-champion", "--second", "champion", "--tracking-uri", registry]
    done = kubealign(env, *push)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "8 tasks added, 0 of the prompts were there already" in done.stdout
    again = kubealign(env, *push)
    assert "0 tasks added, 8 of the prompts were there already" in again.stdout, again.stderr[-2000:]

    admin, second = LabelStudio(url, ADMIN_TOKEN), LabelStudio(url, second_token)
    project = admin.find_project("prefs")
    tasks = admin.tasks(project)
    assert len(tasks) == 8 and all(set(t["data"]) == {"prompt", "answer1", "answer2"} for t in tasks)
    sides = [t["meta"]["kubealign"] for t in tasks]
    assert {s["answer1"] for s in sides} == {"previous-champion:1", "champion:2"}  # shuffled: both on the left

    def choose(client: LabelStudio, task: dict, who: str | None) -> None:
        """Annotate `task` choosing `who`'s answer (None: skip it, as the labeling page's Skip does)."""
        meta = task["meta"]["kubealign"]
        pick = None if who is None else ("left" if meta["answer1"].startswith(f"{who}:") else "right")
        result = (
            []
            if pick is None
            else [{"from_name": "comparison", "to_name": "answer1", "type": "pairwise", "value": {"selected": pick}}]
        )
        client.call("POST", f"/api/tasks/{task['id']}/annotations", {"result": result, "was_cancelled": pick is None})

    for task in tasks[:6]:
        choose(admin, task, "champion")
    choose(second, tasks[0], "champion")  # agrees
    choose(admin, tasks[6], None)  # skipped
    choose(admin, tasks[7], "champion")
    choose(second, tasks[7], "previous-champion")  # disagrees: a tie
    out = tmp_path / "human.jsonl"
    pull = ["feedback", "pull", "--project", "prefs", "--url", url, "--output", out, "--challenger", "champion"]
    done = kubealign(env, *pull)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6
    for row, task in zip(rows, tasks[:6], strict=True):
        meta, data = task["meta"]["kubealign"], task["data"]
        mine = "answer1" if meta["answer1"].startswith("champion:") else "answer2"
        theirs = "answer2" if mine == "answer1" else "answer1"
        assert row == {"prompt": data["prompt"], "chosen": data[mine], "rejected": data[theirs]}
    assert "pending 0, skipped 1, tied 1; annotators 2" in done.stdout
    assert "human win-rate of champion: 1.00" in done.stdout and "agreement 0.50" in done.stdout
