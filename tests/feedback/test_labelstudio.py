"""Human feedback against a real Label Studio (issue 59; `make test-labelstudio`): two tiny registered models
answer 8 held-out prompts, `kubealign feedback push` sends them as pairwise tasks, two people annotate through
Label Studio's API (one task skipped, one where they disagree), `kubealign feedback pull` maps the choices back
to the two versions, counts what it left out, and reports people's agreement and win-rate; pushing again adds
nothing. One of the choices is made in Label Studio's own labeling page, in headless Chromium (annotate_page.py,
Playwright from the same venv); its screenshot is kept in KUBEALIGN_TEST_ARTIFACTS (default runs/test-artifacts).
The server runs from its own venv (KUBEALIGN_LABEL_STUDIO_VENV, built by the make target) on 127.0.0.1 in a
temporary directory."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
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
REPO = Path(__file__).resolve().parents[2]
VENV_ENV = "KUBEALIGN_LABEL_STUDIO_VENV"
ARTIFACTS = REPO / os.environ.get("KUBEALIGN_TEST_ARTIFACTS", "runs/test-artifacts")  # an absolute one stays
ADMIN = ("admin@example.com", "admin-pass-123")
PEOPLE_PAIRS = 96
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


def venv_path(value: str | None) -> Path:
    """The Label Studio venv ($KUBEALIGN_LABEL_STUDIO_VENV, default .venv-labelstudio) as an absolute path: a
    relative one is resolved against the repository, not the working directory (the server runs in a
    temporary directory, where a relative program path is not found)."""
    return REPO / Path(value or ".venv-labelstudio").expanduser()  # `/` keeps an absolute right-hand side


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def label_studio(tmp_path_factory):
    venv = venv_path(os.environ.get(VENV_ENV))
    if not (venv / "bin" / "label-studio").exists():
        pytest.skip(f"no Label Studio venv at {venv} ({VENV_ENV}; `make test-labelstudio` builds one)")
    data = tmp_path_factory.mktemp("label-studio")
    port = free_port()
    env = {
        **os.environ,
        "LABEL_STUDIO_BASE_DATA_DIR": str(data),
        "LABEL_STUDIO_USERNAME": ADMIN[0],
        "LABEL_STUDIO_PASSWORD": ADMIN[1],
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
        yield url, made.stdout.strip().splitlines()[-1], venv
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def kubealign(env: dict[str, str], *args: object) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "kubealign.cli", *map(str, args)]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)


def in_page(venv: Path, url: str, project: int, task: dict, who: str) -> None:
    """`who`'s answer chosen in Label Studio's labeling page by clicking it and pressing Submit (headless
    Chromium); the stored annotation is what the page sent, nothing of kubealign's making."""
    if shutil.which("chromium") is None:
        pytest.skip("Debian's chromium is not installed (.ci/run installs it)")
    side = "left" if task["meta"]["kubealign"]["answer1"].startswith(f"{who}:") else "right"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "label-studio-page.png"
    argv = [str(venv / "bin" / "python"), str(Path(__file__).parent / "annotate_page.py"), url, *ADMIN]
    done = subprocess.run(
        [*argv, *map(str, (project, task["id"], side, shot))], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    stored = json.loads(done.stdout.strip().splitlines()[-1])
    assert [(r["type"], r["from_name"], r["value"]) for r in stored["result"]] == [
        ("pairwise", "comparison", {"selected": side})
    ]
    assert stored["task"] == task["id"] and not stored["was_cancelled"]
    from PIL import Image

    assert Image.open(shot).size == (1280, 800)


def two_registered(tmp_path: Path, champion: Path | None = None) -> tuple[str, dict[str, str]]:
    """A registry holding two versions of the tiny model: 1 (random weights, seed 0) is previous-champion, 2
    (`champion`, else other random weights) champion; (its URI, the environment of a kubealign process using it
    and Label Studio's admin token)."""
    registry = f"sqlite:///{tmp_path / 'registry.db'}"
    env = {**kubealign_env(registry), "LABEL_STUDIO_API_KEY": ADMIN_TOKEN}
    for seed in (0, 1):
        model = tmp_path / f"tiny{seed}"
        if seed == 1 and champion is not None:
            model = champion
        else:
            assert kubealign(env, "tiny-model", "--arch", "opt", "--seed", seed, "--output", model).returncode == 0
        judged = evaluation(tmp_path, f"e{seed}", win=0.7, gain=0.3, reward=1.0 + seed)
        done = kubealign(
            env, "promote", "--evaluation", judged, "--model-dir", model, "--output", tmp_path / f"p{seed}"
        )
        assert done.returncode == 0, done.stderr[-3000:]
    return registry, env


def test_push_annotate_as_two_people_and_pull(label_studio, tmp_path: Path):
    url, second_token, venv = label_studio
    registry, env = two_registered(tmp_path)
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

    for task in tasks[:5]:
        choose(admin, task, "champion")
    in_page(venv, url, project, tasks[5], "champion")  # as a person does it
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
    assert "pending 0, skipped 1, tied 1, duplicates 0; annotators 2" in done.stdout
    assert "human win-rate of champion: 1.00" in done.stdout and "agreement 0.50" in done.stdout
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=registry)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    (feedback,) = [r for r in runs if r.data.tags.get("kubealign.stage") == "feedback"]
    (given,) = feedback.inputs.dataset_inputs
    assert given.dataset.digest == hashlib.sha256(out.read_bytes()).hexdigest()[:36]
    profile = json.loads(given.dataset.profile)
    assert profile["versions"] == ["champion:2", "previous-champion:1"] and len(profile["annotators"]) == 2
    assert feedback.data.tags["kubealign.feedback.challenger_version"] == "2"


def readable(text: str) -> float:
    """How an annotator in this test judges an answer: the share of its characters that are letters, spaces or
    sentence punctuation (a person prefers a sentence to byte soup)."""
    return sum(c.isascii() and (c.isalpha() or c in " .,!?'") for c in text) / max(len(text), 1)


def test_a_reward_model_trained_on_the_pulled_choices_prefers_what_people_chose(label_studio, tmp_path: Path):
    """The loop closed: a fine-tuned champion and an untrained previous champion answer 96 prompts, an annotator
    prefers the more readable answer of each pair, the pulled file is the one data source of a rerun's
    data-split, and the reward model it trains prefers the annotator's choice on pairs it never saw; the runs'
    lineage leads back to the file."""
    url, _, _ = label_studio
    split, sft = tmp_path / "split", tmp_path / "sft"
    env = kubealign_env(f"sqlite:///{tmp_path / 'sft.db'}")
    assert kubealign(env, "data-split", "--set", "data.synthetic_pairs=400", "--output", split).returncode == 0
    assert kubealign(env, "sft", "--data", split, "--output", sft).returncode == 0
    registry, env = two_registered(tmp_path, champion=sft)
    from kubealign.data import phases

    prompts = tmp_path / "prompts.jsonl"
    rows = phases.load(split, "phase3_prompts")["train"]["prompt"][:PEOPLE_PAIRS]
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in rows))
    push = ["feedback", "push", "--project", "flywheel", "--prompts", prompts, "-n", PEOPLE_PAIRS, "--url", url]
    done = kubealign(env, *push, "--first", "previous-champion", "--second", "champion", "--tracking-uri", registry)
    assert done.returncode == 0, done.stderr[-3000:]
    admin = LabelStudio(url, ADMIN_TOKEN)
    for task in admin.tasks(admin.find_project("flywheel")):
        pick = "left" if readable(task["data"]["answer1"]) >= readable(task["data"]["answer2"]) else "right"
        result = [{"from_name": "comparison", "to_name": "comparison", "type": "pairwise", "value": {"selected": pick}}]
        admin.call("POST", f"/api/tasks/{task['id']}/annotations", {"result": result, "was_cancelled": False})
    human = tmp_path / "human.jsonl"
    pull = ["feedback", "pull", "--project", "flywheel", "--url", url, "--output", human, "--challenger", "champion"]
    done = kubealign(env, *pull)
    assert done.returncode == 0, done.stderr[-3000:]
    pulled = [json.loads(line) for line in human.read_text().splitlines()]
    assert len(pulled) == PEOPLE_PAIRS  # each row's sides as the annotator chose them, whatever side they were on
    assert all(readable(r["chosen"]) >= readable(r["rejected"]) for r in pulled)

    rerun, rm = tmp_path / "rerun", tmp_path / "rm"
    only_people = ["--set", f"data.sources=[{{path: {human}}}]", "--set", "data.split_ratios=1,8,1"]
    only_people += ["--set", "data.eval_fraction=0.25", "--set", "data.heldout_reward_fraction=0"]
    done = kubealign(env, "data-split", *only_people, "--output", rerun)
    assert done.returncode == 0, done.stderr[-3000:]
    done = kubealign(
        env, "reward", "--data", rerun, "--set", "promote.guards.min_heldout_win_rate=null", "--output", rm
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((rm / "result.json").read_text())
    assert result["eval_pairs"] >= 10
    # held-out pairs: prompts of phase 2's eval split, which the reward model was not trained on
    assert result["metrics"]["after_accuracy"] >= 0.9 > result["metrics"]["before_accuracy"], result["metrics"]
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=registry)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    inputs = {r.info.run_id: [d.dataset.digest for d in r.inputs.dataset_inputs] for r in runs}
    people = hashlib.sha256(human.read_bytes()).hexdigest()[:36]
    phase2 = json.loads((rerun / "manifest.json").read_text())["phases"]["phase2_reward"]["sha256"][:36]
    assert sum(people in digests for digests in inputs.values()) == 2  # the feedback run and the rerun's data-split
    assert any(phase2 in digests for digests in inputs.values())  # the reward run names the phase it trained on
