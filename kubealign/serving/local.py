"""`kubealign serve`: a registry alias served here by the runtime KServe runs, vLLM's OpenAI-compatible server.

The alias resolves to its version and that version's HF directory is downloaded into the cache (once per
version) and checked whole: the files, every safetensors header, the tokenizer. vLLM's server then runs on
127.0.0.1 from its own venv (vllm_env) with the directory as --model: /v1/models, /v1/completions,
/v1/chat/completions, /metrics. Chat: the tokenizer's own template when it has one (training used it);
otherwise a template that renders the plain dialogue format training used ("\\n\\nHuman: ...\\n\\nAssistant:",
kubealign.data.tokenize), with the BOS the tokenizer adds to plain text. fp32 on CPU by default: vLLM's
greedy tokens then equal transformers' generate of the same directory. vLLM's own output goes to a log
file; one line says when it is ready. SIGINT / SIGTERM stop the server and end with exit code 0.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kubealign.config.serve import ServeConfig
from kubealign.errors import UserError, first_line
from kubealign.serving.identity import version_name
from kubealign.serving.location import Served, missing_files

if TYPE_CHECKING:
    from kubealign.serving.service import Canary


def check_dir(path: Path) -> None:
    """The HF directory whole: its files, each safetensors header readable, its tokenizer loadable."""
    from safetensors import safe_open
    from transformers import AutoTokenizer

    names = [p.name for p in path.iterdir()]
    missing = missing_files(names)
    if missing:
        raise UserError(f"serve: {path} is not a servable model directory: {', '.join(missing)}")
    for weights in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(weights), framework="pt") as handle:
                handle.keys()
        except Exception as exc:  # safetensors raises its own error types for a bad header
            raise UserError(f"serve: {weights}: not a readable safetensors file ({first_line(exc)})") from None
    try:
        AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise UserError(f"serve: {path}: the tokenizer does not load ({first_line(exc)})") from None


def download(served: Served, tracking_uri: str, fresh: bool = False) -> Path:
    """The version's HF directory in the cache (downloaded once: a complete copy has a marker file). The copy is
    keyed by the files' artifact URI as well as the name and version: another registry (a test's, a team's) has
    its own version 1 of the same name, and one copy must never stand for the other."""
    import hashlib

    import mlflow.artifacts

    from kubealign.config.cache import cache_root

    key = hashlib.sha256(f"{served.run_id}\n{served.model_dir_uri}".encode()).hexdigest()[:16]
    target = cache_root() / "served" / served.name / f"{served.version}-{key}"
    if (target / ".complete").exists() and not fresh:
        return target / "model"
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    local = mlflow.artifacts.download_artifacts(
        artifact_uri=served.model_dir_uri, dst_path=str(tmp), tracking_uri=tracking_uri
    )
    Path(local).rename(tmp / "model")
    (tmp / ".complete").write_text(served.model_dir_uri, encoding="utf-8")
    if target.exists():
        import shutil

        shutil.rmtree(target)
    tmp.rename(target)
    return target / "model"


def port_free(port: int) -> None:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            raise UserError(f"--port {port}: 127.0.0.1:{port} is in use ({exc.strerror})") from None


def command(python: Path, model_dir: Path, served: Served, port: int, cfg: ServeConfig, template: Path | None) -> list:
    """vLLM's server of `served`: it answers to the registered model's name and to the version's model URI,
    which the judge reads from /v1/models to know which version it serves (kubealign.serving.identity)."""
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    argv += ["--served-model-name", served.name, version_name(served.name, served.version)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--dtype", cfg.cpu_dtype]
    if cfg.max_model_len:
        argv += ["--max-model-len", str(cfg.max_model_len)]
    if template is not None:
        argv += ["--chat-template", str(template)]
    if cfg.tool_call_parser:  # as the InferenceService's predictor gets it (serving.manifest)
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", cfg.tool_call_parser]
    return argv


def models(port: int) -> list[dict[str, Any]] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as reply:
            return json.loads(reply.read())["data"]
    except (OSError, ValueError, KeyError):
        return None


def launch(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """Start vLLM's server in its own process group (its engine and workers), its output to `log`."""
    with log.open("ab") as out:
        return subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=log.parent
        )


def wait_answering(proc: subprocess.Popen, log: Path, port: int, start_timeout_s: float) -> None:
    """Until /v1/models answers on the port; an exit or the timeout is one line naming the log."""
    deadline = time.monotonic() + start_timeout_s
    while models(port) is None:
        if proc.poll() is not None:
            tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:]
            raise UserError(f"serve: vLLM's server exited with code {proc.returncode}: {' '.join(tail)} (log: {log})")
        if time.monotonic() > deadline:
            stop(proc)
            raise UserError(f"serve: vLLM's server did not answer in {start_timeout_s:.0f} s (log: {log})")
        time.sleep(1)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (its engine and workers), SIGKILL after 30 s."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


class _Terminated(Exception):
    pass


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated


def chat_template(model_dir: Path) -> Path | None:
    """None when the tokenizer has its own chat template; else the plain-format one, written beside the dir."""
    from transformers import AutoTokenizer

    from kubealign.serving.chat import template_for

    template = template_for(AutoTokenizer.from_pretrained(model_dir))
    if template is None:
        return None
    path = model_dir.parent / "plain-chat-template.jinja"
    path.write_text(template, encoding="utf-8")
    return path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def resolved(cfg: ServeConfig, tracking_uri: str, name: str, aliases: list[str]) -> list[tuple[Served, Path]]:
    """Each alias's version and its checked HF directory in the cache."""
    from mlflow.tracking import MlflowClient

    from kubealign.promotion.aliases import registry_errors
    from kubealign.serving import location

    with registry_errors(tracking_uri):
        client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        found = [location.resolve(client, name, alias, tracking_uri) for alias in aliases]
        if len(found) == 2 and found[0].version == found[1].version:
            raise UserError(
                f"--canary {aliases[1]}: it is version {found[0].version}, as {aliases[0]} is: nothing to split"
            )
        dirs = verified_copies(found, tracking_uri)
    return list(zip(found, dirs, strict=True))


def verified_copies(found: list[Served], tracking_uri: str) -> list[Path]:
    """Each version's HF directory in the cache, its files checked against the version's provenance manifest
    and whole (check_dir). The cached copy is hashed again at every use (the cache is a directory anyone can
    write); one that differs is downloaded again once, and that copy must match. Registry errors are the
    caller's to turn into one line (registry_errors)."""
    from kubealign.provenance.digests import file_digests, mismatches
    from kubealign.serving import location

    dirs = []
    for served in found:
        recorded = location.recorded_files(served, tracking_uri)
        model_dir = download(served, tracking_uri)
        if mismatches(file_digests(model_dir), recorded["files"]):  # hashed once when the cached copy is right
            model_dir = download(served, tracking_uri, fresh=True)
            location.check_files(served, model_dir, recorded)
        check_dir(model_dir)
        dirs.append(model_dir)
    return dirs


def serve(cfg: ServeConfig, tracking_uri: str, name: str, port: int, canary: Canary | None = None) -> None:
    """Serve `cfg.alias` of `name` on 127.0.0.1:port until SIGINT or SIGTERM; with a canary (alias, percent),
    both aliases' servers on free ports behind the traffic split (kubealign.serving.split) on the port."""
    from kubealign.serving import split, vllm_env

    port_free(port)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # quiet: one line says what is served
    models_ = resolved(cfg, tracking_uri, name, [cfg.alias, *([canary.alias] if canary else [])])
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_gib)}
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    procs: dict[str, subprocess.Popen] = {}
    front = None
    started = time.monotonic()
    try:
        ports = [port] if canary is None else [free_port() for _ in models_]
        backends = [
            split.Backend(s.alias, s.version, f"http://127.0.0.1:{p}") for (s, _), p in zip(models_, ports, strict=True)
        ]
        for (served, model_dir), own in zip(models_, ports, strict=True):  # both start at once, then each is waited for
            argv = command(vllm_env.python(), model_dir, served, own, cfg, chat_template(model_dir))
            procs[served.version] = launch(argv, env, model_dir.parent / "vllm.log")
        for (served, model_dir), own in zip(models_, ports, strict=True):
            wait_answering(procs[served.version], model_dir.parent / "vllm.log", own, cfg.start_timeout_s)
        route = split.Route(backends[0], backends[1], canary.percent) if canary else None
        front = split.start(port, route) if route else None
        logs = {served.version: model_dir.parent / "vllm.log" for served, model_dir in models_}
        print(ready_line(name, backends, port, route, time.monotonic() - started, logs), flush=True)
        watch(procs, route, logs)
    except (KeyboardInterrupt, _Terminated):
        print("serve: stopped", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if front is not None:
            front.stop()
        for proc in procs.values():
            stop(proc)


def ready_line(name: str, backends: list, port: int, route: Any, took_s: float, logs: dict[str, Path]) -> str:
    where = f"http://127.0.0.1:{port}/v1"
    done = f"ready in {took_s:.0f} s; Ctrl-C stops it (vLLM's log: {', '.join(map(str, logs.values()))})"
    if route is None:
        return f"serve: {name}@{backends[0].alias} (version {backends[0].version}) at {where}, {done}"
    stable, canary = backends
    return (
        f"serve: {name}@{stable.alias} (version {stable.version}) {100 - route.percent} % and @{canary.alias} "
        f"(version {canary.version}) {route.percent} % of the requests at {where}, {done}\n"
        f"  each alone: {stable.alias} {stable.url}, {canary.alias} {canary.url}; "
        f"judge it: kubealign judge --front http://127.0.0.1:{port} ..."
    )


def watch(procs: dict[str, subprocess.Popen], route: Any, logs: dict[str, Path]) -> None:
    """Until a server exits (one line); a server the route no longer uses is stopped."""
    while True:
        for version, proc in procs.items():
            if proc.poll() is not None:
                where = f"(log: {logs[version]})"
                raise UserError(f"serve: vLLM's server of version {version} exited with code {proc.returncode} {where}")
        if route is not None and route.changed.is_set():
            route.changed.clear()
            kept = {backend.version for backend in route.served()}
            for version in [v for v in procs if v not in kept]:
                stop(procs.pop(version))
                print(
                    f"serve: version {', '.join(kept)} alone now; the server of version {version} stopped", flush=True
                )
        time.sleep(0.5)
