"""What MLflow's basic-auth costs a registry, with and without its credential cache (issue 54).

Three `mlflow server` processes in turn, each on a fresh sqlite store under a temp dir, listening on
127.0.0.1 with one worker (so the figures are one worker's): without authentication; with MLflow's
basic-auth app as MLflow ships it (credential cache off); with kubealign's ini (the chart's,
`kubealign.cluster.registry_auth.config_text`: the cache on for AUTH_CACHE_TTL_S). Through each, as the
admin where authentication is on, the MLflow client makes REQUESTS sequential `log_metric` calls and as many
`search_model_versions`, the two calls a pipeline makes most. Reported: ms per request and requests/s of
each, and the ratio of each authenticated server's time to the unauthenticated one's (same run, same
machine: the figures to compare).

    .venv/bin/python benchmarks/registry_auth_cost.py [--requests 60]

Writes benchmarks/results/registry-auth-cost-<host>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ADMIN = ("admin", "bench-admin-password-1")
START_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(root: Path, ini: str | None) -> tuple[subprocess.Popen, str]:
    """An `mlflow server` on a fresh store under root; with `ini`, MLflow's basic-auth app reading it."""
    root.mkdir(parents=True)
    port = free_port()
    argv = [
        str(Path(sys.executable).with_name("mlflow")),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination",
        str(root / "artifacts"),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    if ini is not None:
        (root / "basic_auth.ini").write_text(ini, encoding="utf-8")
        argv.append("--app-name=basic-auth")
        env |= {
            "MLFLOW_AUTH_CONFIG_PATH": str(root / "basic_auth.ini"),
            "MLFLOW_AUTH_ADMIN_USERNAME": ADMIN[0],
            "MLFLOW_AUTH_ADMIN_PASSWORD": ADMIN[1],
            "MLFLOW_FLASK_SERVER_SECRET_KEY": "bench",
        }
    log = (root / "server.log").open("ab")
    proc = subprocess.Popen(argv, stdout=log, stderr=log, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"mlflow server exited: {(root / 'server.log').read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return proc, url
        except OSError:
            time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGKILL)
    sys.exit(f"mlflow server on {url} did not answer /health in {START_TIMEOUT_S} s")


def measure(url: str, requests: int, auth: bool) -> dict[str, float]:
    from mlflow.tracking import MlflowClient

    if auth:
        os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"] = ADMIN
    else:
        os.environ.pop("MLFLOW_TRACKING_USERNAME", None)
        os.environ.pop("MLFLOW_TRACKING_PASSWORD", None)
    client = MlflowClient(url)
    run = client.create_run(client.create_experiment("bench"))
    client.log_metric(run.info.run_id, "warm-up", 0.0)  # the first request pays the cache miss
    figures = {}
    for what, call in (
        ("log_metric", lambda i: client.log_metric(run.info.run_id, "loss", float(i), step=i)),
        ("search_model_versions", lambda i: client.search_model_versions(max_results=10)),
    ):
        started = time.perf_counter()
        for i in range(requests):
            call(i)
        seconds = time.perf_counter() - started
        figures[f"{what}_ms"] = round(1000 * seconds / requests, 2)
        figures[f"{what}_per_s"] = round(requests / seconds, 1)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=60)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from train_throughput import machine

    from kubealign.cluster.registry_auth import AUTH_CACHE_TTL_S, config_text

    servers = {
        "no-auth": None,
        "basic-auth, cache off (MLflow's default)": config_text("sqlite:///{root}/auth.db").replace(
            f"auth_cache_ttl_seconds = {AUTH_CACHE_TTL_S}\n", ""
        ),
        f"basic-auth, kubealign's ini (cache {AUTH_CACHE_TTL_S} s)": config_text("sqlite:///{root}/auth.db"),
    }
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k, (name, ini) in enumerate(servers.items()):
            root = Path(tmp) / str(k)
            proc, url = start(root, ini.replace("{root}", str(root)) if ini else None)
            try:
                results[name] = measure(url, args.requests, auth=ini is not None)
            finally:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
            print(name, results[name], flush=True)
    base = results["no-auth"]
    for figures in results.values():
        for what in ("log_metric", "search_model_versions"):
            figures[f"{what}_x_no_auth"] = round(figures[f"{what}_ms"] / base[f"{what}_ms"], 2)
    out = HERE / "results" / f"registry-auth-cost-{platform.node() or 'host'}.json"
    record = {"machine": machine(), "requests": args.requests, "workers": 1, "results": results}
    out.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
