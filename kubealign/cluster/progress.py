"""A TrainJob's progress and metrics where the cluster shows them: Kubeflow Trainer v2.3's status.trainerStatus.

With the controller's TrainJobStatus feature gate on, the Trainer gives every node's container the address of its
status server and the credentials to call it (KUBEFLOW_TRAINER_SERVER_URL, _CA_CERT: a CA file, _TOKEN: a
projected token file that rotates, so it is read again for every call). A POST of {"trainerStatus": {...}} there
(kubeflow/trainer v2.3.0 pkg/statusserver, docs/user-guides/trainjob-progress.md) sets the TrainJob's
status.trainerStatus: progressPercentage, estimatedRemainingSeconds, metrics (name/value strings, at most 64
characters each, at most 256 of them) and lastUpdatedTime (required). `kubectl get trainjob -o
jsonpath='{.status.trainerStatus}'` and the Kubeflow UI read it.

The ppo stage reports from rank 0 after each iteration, at most every MIN_INTERVAL_S (the Trainer's guidance: 5 s)
and once more at the end. Outside a TrainJob (the variables absent) nothing is sent; a failed call is one line on
screen, the first time, and never stops training.
"""

from __future__ import annotations

import json
import math
import os
import ssl
import time
import urllib.request
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

URL_ENV = "KUBEFLOW_TRAINER_SERVER_URL"
CA_ENV = "KUBEFLOW_TRAINER_SERVER_CA_CERT"
TOKEN_ENV = "KUBEFLOW_TRAINER_SERVER_TOKEN"
MIN_INTERVAL_S = 5.0
# The iteration's metrics shown on the TrainJob (those of them an iteration has), in this order.
SHOWN = ("iteration", "reward_mean", "reward_std", "kl", "kl_coef", "policy_loss", "value_loss", "entropy",
         "approx_kl", "clip_fraction", "samples_per_s")  # fmt: skip
LIMIT = 64  # characters of a metric's name and of its value (the CRD's maxLength)


def trainer_status(
    done: int, total: int, elapsed_s: float, metrics: Mapping[str, float], now: datetime, first: int = 0
) -> dict:
    """status.trainerStatus after DONE of TOTAL iterations, ELAPSED_S after iteration FIRST (a resumed run's start):
    the percentage, the time left at this process's pace (absent before its first iteration), the SHOWN metrics
    that are finite."""
    status: dict[str, Any] = {"progressPercentage": max(0, min(100, int(100 * done / max(total, 1))))}
    if done > first:
        status["estimatedRemainingSeconds"] = max(0, int(round(elapsed_s / (done - first) * (total - done))))
    shown = []
    for name in SHOWN:
        value = metrics.get(name)
        if isinstance(value, int | float) and math.isfinite(value):
            shown.append({"name": name[:LIMIT], "value": f"{value:.6g}"[:LIMIT]})
    status["metrics"] = shown
    status["lastUpdatedTime"] = now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return status


class Reporter:
    """Posts trainer_status to the Trainer's status server (rank 0, inside a TrainJob; otherwise does nothing)."""

    def __init__(
        self,
        main: bool,
        first: int = 0,
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        send: Callable[[str, dict, str, str], None] | None = None,
    ):
        env = os.environ if environ is None else environ
        self.url, self.ca, self.token = (env.get(key, "") for key in (URL_ENV, CA_ENV, TOKEN_ENV))
        self.enabled = main and bool(self.url and self.token)
        self.clock, self.send = clock, send or post
        self.started, self.first = clock(), first  # a resumed run's pace counts its own iterations only
        self.last: float | None = None
        self.warned = False

    def report(self, done: int, total: int, metrics: Mapping[str, float], final: bool = False) -> bool:
        """Send the progress after DONE of TOTAL iterations (throttled unless FINAL); True if it was sent."""
        now = self.clock()
        if not self.enabled or (not final and self.last is not None and now - self.last < MIN_INTERVAL_S):
            return False
        self.last = now
        status = trainer_status(done, total, now - self.started, metrics, datetime.now(UTC), self.first)
        body = {"trainerStatus": status}
        try:
            self.send(self.url, body, self.ca, self.token)
        except Exception as exc:  # noqa: BLE001 - the status is a view of training, never a reason to stop it
            if not self.warned:
                print(f"TrainJob status: could not report progress to {self.url}: {exc}", flush=True)
                self.warned = True
            return False
        return True


def post(url: str, body: dict, ca_file: str, token_file: str) -> None:
    """POST BODY as JSON with the bearer token read now from TOKEN_FILE, verified against CA_FILE (https)."""
    with open(token_file, encoding="utf-8") as handle:
        token = handle.read().strip()
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method="POST",
    )
    context = ssl.create_default_context(cafile=ca_file or None) if url.startswith("https:") else None
    with urllib.request.urlopen(request, timeout=5, context=context) as answer:
        answer.read()
