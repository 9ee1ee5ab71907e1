"""checkov over what a cluster runs: the chart rendered for every tested value set, and both
Dockerfiles. No failed check is allowed; the skipped ones are listed, each with its reason, in
.checkov.yaml (the one place)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import helm_python as helm
import pytest

from tests.cluster.test_chart import CHART, VALUE_SETS

pytestmark = pytest.mark.chart

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / ".checkov.yaml"


def checkov() -> str:
    found = REPO / ".venv-tools" / "bin" / "checkov"
    if found.exists():
        return str(found)
    if shutil.which("checkov"):
        return shutil.which("checkov")
    if os.environ.get("CI"):
        pytest.fail("checkov is not installed: `make test` creates .venv-tools from requirements/lock-tools.txt")
    pytest.skip("checkov not installed (make test installs it into .venv-tools)")


def skipped_checks() -> dict[str, str]:
    """Check id -> reason, from .checkov.yaml's skip-check list."""
    found = re.findall(r"^\s+- (CKV\w+)\s+#\s*(.+)$", CONFIG.read_text(encoding="utf-8"), flags=re.M)
    return dict(found)


def test_every_skip_has_a_reason() -> None:
    text = CONFIG.read_text(encoding="utf-8")
    listed = re.findall(r"^\s+- (CKV\w+)", text, flags=re.M)
    assert listed and sorted(listed) == sorted(skipped_checks())  # none without a '# reason'
    assert all(len(reason) > 40 for reason in skipped_checks().values())


def scan(directory: Path, *options: str) -> list[dict]:
    proc = subprocess.run(
        [checkov(), *options, "-d", str(directory), "-o", "json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        cwd=directory,  # checkov reads ./.checkov.yaml on its own: only --config-file may bring the skips
    )
    reports = json.loads(proc.stdout)
    return reports if isinstance(reports, list) else [reports]


def failures(reports: list[dict]) -> list[tuple[str, str]]:
    return [
        (c["check_id"], f"{c['check_name']} ({c['resource']})") for r in reports for c in r["results"]["failed_checks"]
    ]


@pytest.fixture(scope="module")
def scanned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("scan")
    chart = helm.Chart.load(CHART)
    (root / "k8s").mkdir()
    for name, values in VALUE_SETS.items():
        rendered = chart.render(values, name="ka", namespace="kubeflow", is_install=True)
        text = "\n---\n".join(doc for doc in rendered.values() if doc.strip())
        (root / "k8s" / f"{name}.yaml").write_text(text, encoding="utf-8")
    for image in ("train", "cpu", "serve"):
        (root / "images" / image).mkdir(parents=True)
        shutil.copy(REPO / "images" / image / "Dockerfile", root / "images" / image / "Dockerfile")
    return root


def test_checkov_passes_on_rendered_chart_and_dockerfiles(scanned: Path) -> None:
    reports = scan(scanned, "--config-file", str(CONFIG))
    assert failures(reports) == []
    assert {r["check_type"] for r in reports} == {"kubernetes", "dockerfile"}
    assert sum(r["summary"]["passed"] for r in reports) > 100  # the scan really looked at the manifests


def test_every_skip_is_still_needed(scanned: Path) -> None:
    """Without the skip list, exactly the listed checks fail: no stale skip hides a fixed problem."""
    reports = scan(scanned, "--framework", "kubernetes", "dockerfile", "--quiet", "--compact")
    assert {check for check, _ in failures(reports)} == set(skipped_checks())
