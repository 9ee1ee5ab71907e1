"""The DAG's optional `judge` task (issue 39), after `serve` in promote.mode canary: the canary the serve task
put beside the champion is judged online, in the cluster, and the verdict carried out.

Reads serve's result: when it applied no canary (promote moved nothing, or made a first champion), there is
nothing to judge and the task says so. Otherwise each predictor is asked by its own pods' address
(kubealign.serving.endpoints: the service URL would split the prompts between them), each checked to serve the
version the registry says (kubealign.serving.identity: the champion's, the canary's), the judge runs as
`kubealign judge` does (kubealign.stages.judge), and with canary.act (the default) its verdict is carried out
as `kubealign judge --act --namespace` does: the registry under promote's lease and journal, then the
InferenceService (the champion alone), waiting for Ready. OUTPUT holds the judge's files and acted.json.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kubealign.config import KubealignConfig
from kubealign.errors import UserError
from kubealign.outputs import atomic_dir, check_output_path, read_result, write_json, write_result

STAGE = "judge"


def run(
    config: KubealignConfig,
    prompts: Path,
    tokenizer_dir: Path,
    reward: Path | None,
    serving_dir: Path,
    output: Path,
    apis: tuple[Any, Any] | None = None,
) -> dict[str, Any]:
    """apis: (CustomObjectsApi, CoreV1Api) of the cluster (default: the one this pod runs in)."""
    from kubealign.serving import act, ask, endpoints, identity
    from kubealign.stages import judge

    check_output_path(output, STAGE)
    serving = read_result(serving_dir)
    if serving.get("stage") != "serve":
        raise UserError(f"--serving {serving_dir}: result.json is from stage {serving.get('stage')!r}")
    canary = serving.get("canary")
    if not serving.get("applied") or not canary:
        why = "serve applied no canary: nothing to judge"
        print(f"judge: {why}", flush=True)
        with atomic_dir(output) as tmp:
            return write_result(tmp, STAGE, {"judged": 0.0}, {}, judged=False, why=why)
    namespace, name = serving["inference_service"].split()[-1].split("/")
    if apis is None:
        from kubealign.cluster.trainjob import connect

        apis = connect()
    custom, core = apis
    stable = endpoints.predictor_url(core, namespace, name, endpoints.STABLE, str(serving["version"]))
    version = str(canary["version"])
    other = endpoints.predictor_url(core, namespace, name, endpoints.CANARY, version)
    names = {"champion": ask.served_model(stable), "canary": ask.served_model(other)}
    from kubealign.tracking.runs import resolve_uri

    uri, registered = resolve_uri(config), config.promote.registered_model
    if config.canary.act and not uri:
        raise UserError("judge: no registry (MLFLOW_TRACKING_URI, tracking.uri) to carry the verdict out in")
    if uri:  # each pod serves the version the registry says, before any prompt (kubealign.serving.identity)
        expected = identity.expected_versions(uri, registered, version)
        checked = identity.check({"champion": stable, "canary": other}, expected, registered, names)
    else:
        checked = identity.unchecked("no registry (MLFLOW_TRACKING_URI, tracking.uri) to read")
        print(f"judge: {checked[0]}", flush=True)
    inputs = (stable, other, output, names, version, tuple(checked))
    result = judge.run(config, prompts, tokenizer_dir, reward, *inputs)
    if not config.canary.act:
        return result
    after = act.in_registry(config, uri, result["promoted"], version)
    action = act.in_serving(config, uri, namespace, custom)
    acted = {"registry": after, "inference_service": f"{namespace}/{name}", "action": action}
    write_json(output / "acted.json", acted)
    print(f"judge: registry {after}; InferenceService {namespace}/{name} {action}, Ready", flush=True)
    return {**result, "acted": acted}
