"""The DAG's optional `act` task, after `judge` with canary.act (the default): the judge's verdict carried out.

Reads the judge task's verdict.json (kubealign.stages.judge_task.VERDICT_FILE) and makes it true as `kubealign
judge --act --namespace` does (kubealign.serving.carry_out): the registry's aliases under promote's lease and journal,
then the InferenceService (the champion alone), waiting for Ready. It runs no user code, so its pod holds the
pipeline identity, the one that may move `champion`; the judge, which runs the reward functions, holds the
tracking identity (kubealign.cluster.secrets). A crash between the registry and the cluster is finished by
running this task again (`kubealign rerun act`): it finds the registry as the verdict wants it, moves nothing
and finishes the service. A verdict file that is not the judge's whole verdict is refused in one line naming it.
OUTPUT: result.json (the aliases after, the InferenceService and what was done to it).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from kubealign.config import KubealignConfig
from kubealign.errors import UserError, first_line
from kubealign.outputs import atomic_dir, check_output_path, write_result
from kubealign.stages.judge_task import VERDICT_FILE

STAGE = "act"
SERVICE = re.compile(r"[^/\s]+/[^/\s]+")  # NAMESPACE/NAME


def read_verdict(judgement: Path, registered_model: str) -> dict[str, Any]:
    """The judge task's verdict in `judgement`, checked whole (kubealign.stages.judge_task.VERDICT_FILE)."""
    path = judgement / VERDICT_FILE
    try:
        verdict = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: no such file: the judge task writes it last; judge again") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}: not a verdict: invalid JSON: {exc.msg}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: not a verdict: {first_line(exc)}") from None
    problem = verdict_problem(verdict, registered_model)
    if problem is not None:
        raise UserError(f"{path}: not a verdict: {problem}")
    return verdict


def verdict_problem(verdict: Any, registered_model: str) -> str | None:
    """What is wrong with a verdict (None: nothing)."""
    if not isinstance(verdict, dict):
        return f"a JSON {type(verdict).__name__}, not an object"
    if not isinstance(verdict.get("judged"), bool):
        return f'"judged" is {verdict.get("judged")!r}, not true or false'
    if not verdict["judged"]:
        return None
    if not isinstance(verdict.get("promoted"), bool):
        return f'"promoted" is {verdict.get("promoted")!r}, not true or false'
    version = verdict.get("version")
    if not isinstance(version, str) or not re.fullmatch(r"[0-9]+", version):
        return f'"version" is {version!r}, not a registered version number'
    named = verdict.get("registered_model")
    if named != registered_model:
        return f'"registered_model" is {named!r}, not promote.registered_model {registered_model!r}'
    service = verdict.get("inference_service")
    if not isinstance(service, str) or not SERVICE.fullmatch(service):
        return f'"inference_service" is {service!r}, not NAMESPACE/NAME'
    return None


def run(config: KubealignConfig, judgement: Path, output: Path, custom: Any = None) -> dict[str, Any]:
    """judgement: the judge task's output; custom: a kubernetes CustomObjectsApi (default: the cluster this pod
    runs in)."""
    from kubealign.serving import carry_out
    from kubealign.tracking.runs import resolve_uri

    check_output_path(output, STAGE)
    verdict = read_verdict(judgement, config.promote.registered_model)
    why = None
    if not verdict["judged"]:
        why = f"nothing to carry out: {verdict.get('why') or 'nothing was judged'}"
    elif not config.canary.act:  # the run's config_json says so, whatever the pipeline was compiled with
        why = "canary.act is false: the verdict is reported, not carried out"
    if why is not None:
        print(f"act: {why}", flush=True)
        with atomic_dir(output) as tmp:
            return write_result(tmp, STAGE, {"acted": 0.0}, {}, acted=False, why=why)
    uri = resolve_uri(config)
    if not uri:
        raise UserError("act: no registry (MLFLOW_TRACKING_URI, tracking.uri) to carry the verdict out in")
    promoted, version, service = verdict["promoted"], verdict["version"], verdict["inference_service"]
    after = carry_out.in_registry(config, uri, promoted, version)
    registry = ", ".join(f"{alias} = {value}" for alias, value in after.items())
    print(f"act: registry {registry}", flush=True)
    if custom is None:
        from kubealign.cluster.trainjob import connect

        custom, _ = connect()
    action = carry_out.in_serving(config, uri, service.split("/")[0], custom)
    summary = f"registry {registry}; InferenceService {service} {action}, Ready"
    print(f"act: InferenceService {service} {action}, Ready", flush=True)
    details = {"promoted": promoted, "version": version, "verdict": verdict.get("verdict", "")}
    details.update(registry=after, inference_service=service, action=action, summary=summary)
    with atomic_dir(output) as tmp:
        return write_result(tmp, STAGE, {"acted": 1.0, "promoted": float(promoted)}, {}, acted=True, **details)
