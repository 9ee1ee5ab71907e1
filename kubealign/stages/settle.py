"""The DAG's `settle` task (canary.await_people): the canary the previous run left waiting for people, decided now
that they have.

In a scheduled round the judge task judges its canary before anyone has seen what it served, so people's check
(canary.min_human_win_rate) could only fail. With canary.await_people the judge holds the verdict instead
(kubealign.serving.verdict.awaits_people: people's approval is all it lacks), the canary keeps serving its share
and the push task sends its pairs to people. The next run's feedback task pulls their choices; this task, after it
and before promote, finds the judge run that waits on the registry's `challenger` (kubealign.serving.pending),
decides again on that run's recorded figures with people's win-rate and the judges' latest agreement with them
(kubealign.serving.verdict.decide, as the judge does), and carries the verdict out as the act task does: the
registry's aliases under promote's lease, then the InferenceService (kubealign.stages.act.carry). Promote then
gates this run's candidate against the champion as it now stands.

Nothing is done, and the line says why, when: no version is `challenger`; no judge run waits on it; the champion
is no longer the one it was compared with (the recorded figures no longer hold); or people have not decided on it
yet (it keeps serving; this run's promote may put a new challenger in its place). It runs no user code: the task
of the pipeline identity. A crash between the registry and the service leaves `challenger` cleared, so a rerun
finds nothing to settle; the serve task of a run whose promote moves an alias, or `kubealign judge --act
--namespace`, makes the service again from the registry.
OUTPUT: result.json (the checks, the verdict line, the aliases after, what was done to the InferenceService).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kubealign.config import KubealignConfig
from kubealign.errors import UserError
from kubealign.outputs import atomic_dir, check_output_path, write_result

STAGE = "settle"


def waiting(config: KubealignConfig, uri: str) -> tuple[str, Any, str | None]:
    """(the `challenger` version, its waiting judge run, None) when there is a verdict to finish, else ("", None,
    why not)."""
    from mlflow.tracking import MlflowClient

    from kubealign.promotion.aliases import CHALLENGER, CHAMPION, read_state, registry_errors
    from kubealign.serving import pending

    name = config.promote.registered_model
    with registry_errors(uri):
        client = MlflowClient(uri)
        aliases = read_state(client, name)[0]
        version = aliases.get(CHALLENGER)
        if version is None:
            return "", None, f"{name} has no {CHALLENGER}: no canary waits for people"
        experiment = client.get_experiment_by_name(config.tracking.experiment)
        run = None if experiment is None else pending.find(client, experiment.experiment_id, name, version)
    if run is None:
        return "", None, f"{CHALLENGER} version {version} has no judgement waiting for people: left as it is"
    against, now = run.data.tags.get(pending.CHAMPION_TAG), aliases.get(CHAMPION)
    if against != now:
        why = f"version {version} was judged against champion version {against}, the champion is now {now}"
        return "", None, f"{why}: the judgement no longer holds; left as it is"
    return version, run, None


def run(config: KubealignConfig, output: Path, custom: Any = None) -> dict[str, Any]:
    """custom: a kubernetes CustomObjectsApi (default: the cluster this pod runs in)."""
    from kubealign.feedback import lookup
    from kubealign.serving import pending
    from kubealign.serving import verdict as rules
    from kubealign.stages.act import carry, served_service
    from kubealign.tracking.runs import resolve_uri

    check_output_path(output, STAGE)
    if not config.canary.await_people:  # the run's config_json says so, whatever the pipeline was compiled with
        return nothing(output, "canary.await_people is false: no verdict waits for people")
    uri = resolve_uri(config)
    if not uri:
        raise UserError("settle: no registry (MLFLOW_TRACKING_URI, tracking.uri) to find the waiting canary in")
    version, judged, why = waiting(config, uri)
    if judged is None:
        return nothing(output, why or "")
    human, agreement = lookup.people(uri, config, version)
    if human is None or human.decided == 0:
        return nothing(output, f"people have not decided on version {version} yet: it keeps serving its share")
    online, pairs, canary = pending.recorded(judged.data.metrics)
    if online is not None:
        online.update(agreement)  # the judges as people see them now, this run's pull included
    promoted, lines = rules.decide(online, pairs, canary, config.promote, config.canary, human)
    verdict = rules.verdict_line(promoted, lines, "challenger", version)
    print("\n".join([verdict.replace("judge:", f"{STAGE}:", 1), *[f"  {line}" for line in lines]]), flush=True)
    namespace, service = served_service(config)
    details = carry(config, uri, namespace, service, promoted, version, custom, STAGE)
    metrics = {"acted": 1.0, "promoted": float(promoted), "human_win_rate": human.win_rate, "decided": human.decided}
    with atomic_dir(output) as tmp:
        more = {"checks": lines, "judge_run": judged.info.run_id, "people": human.source}
        return write_result(tmp, STAGE, metrics, {}, acted=True, verdict=verdict, **more, **details)


def nothing(output: Path, why: str) -> dict[str, Any]:
    print(f"{STAGE}: {why}", flush=True)
    with atomic_dir(output) as tmp:
        return write_result(tmp, STAGE, {"acted": 0.0}, {}, acted=False, why=why)
