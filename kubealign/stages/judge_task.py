"""The DAG's optional `judge` task, after `serve` in promote.mode canary: the canary the serve task
put beside the champion is judged online, in the cluster, and the verdict written down for the `act` task.

Reads serve's result: when it applied no canary (promote moved nothing, or made a first champion), there is
nothing to judge and the task says so. Otherwise each predictor is asked by its own pods' address
(kubealign.serving.endpoints: the service URL would split the prompts between them), each checked to serve the
version the registry says (kubealign.serving.identity: the champion's, the canary's), and the judge runs as
`kubealign judge` does (kubealign.stages.judge). It scores with the reward functions (user code), so its pod
holds the tracking identity (kubealign.cluster.secrets): it reads the registry and moves nothing. OUTPUT holds
the judge's files and verdict.json, what the `act` task (kubealign.stages.act; canary.act) carries out: the
registry under promote's lease and journal, then the InferenceService, as the pipeline identity.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kubealign.config import KubealignConfig
from kubealign.errors import UserError
from kubealign.outputs import atomic_dir, check_output_path, read_result, write_json, write_result

STAGE = "judge"
# the verdict as the act task reads it: {"judged": false, "why"} when nothing was judged, else {"judged": true,
# "promoted", "version" (the judged canary's), "registered_model", "inference_service" ("NAMESPACE/NAME"),
# "verdict" (the line), "awaiting_people" (canary.await_people: nothing to carry out yet, the next run's settle
# task decides)}
VERDICT_FILE = "verdict.json"


def run(
    config: KubealignConfig,
    prompts: Path,
    tokenizer_dir: Path,
    reward: Path | None,
    serving_dir: Path,
    output: Path,
    core: Any = None,
) -> dict[str, Any]:
    """core: the CoreV1Api of the cluster (default: the one this pod runs in)."""
    from kubealign.serving import ask, endpoints, identity
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
            write_json(tmp / VERDICT_FILE, {"judged": False, "why": why})
            return write_result(tmp, STAGE, {"judged": 0.0}, {"verdict": VERDICT_FILE}, judged=False, why=why)
    namespace, name = serving["inference_service"].split()[-1].split("/")
    if core is None:
        from kubealign.cluster.trainjob import connect

        core = connect()[1]
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
    from kubealign.feedback import fresh, lookup

    # people's verdict (canary.min_human_win_rate) and the judges' agreement with them (min_judge_agreement)
    human, agreement = lookup.people(uri, config, version)
    agreement = {**agreement, **fresh.of_reward_dir(reward)}  # the scorer's own check against people, if it had one
    inputs = (stable, other, output, names, version, tuple(checked), human)
    result = judge.run(
        config, prompts, tokenizer_dir, reward, *inputs, champion_version=str(serving["version"]), agreement=agreement
    )
    verdict = {"judged": True, "promoted": bool(result["promoted"]), "version": version}
    verdict["awaiting_people"] = bool(result.get("awaiting_people"))  # canary.await_people: the next run settles it
    verdict.update(registered_model=registered, inference_service=f"{namespace}/{name}", verdict=result["verdict"])
    write_json(output / VERDICT_FILE, verdict)  # last: a judge that stopped before it has no verdict to act on
    return result
