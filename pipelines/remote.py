"""`kubealign compile` and `kubealign submit`: the DAG as KFP IR YAML, and a run on a Kubeflow cluster.

Submission goes through kfp.Client with its standard authentication: in-cluster service-account
tokens (KF_PIPELINES_SA_TOKEN_PATH), `--token` / KFP_TOKEN for a bearer token, or the cookie and
context settings kfp keeps in ~/.config/kfp/context.json.

MLflow: when this machine can reach the tracking server (MLFLOW_TRACKING_URI or tracking.uri), submit
creates the pipeline run's parent MLflow run and bakes KUBEALIGN_PARENT_RUN_ID and
MLFLOW_EXPERIMENT_ID into every task's environment, so each stage's run nests under it. Environment
variables are not part of KFP's cache fingerprint (image, command, arguments, inputs), so cached tasks
are still reused. Where KFP's MLflow integration injects MLFLOW_RUN_ID into the task instead, the stage
logs into that run (see kubealign.tracking.runs); `--no-parent-run` leaves nesting to it entirely.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from kubealign.config import KubealignConfig
from kubealign.errors import UserError, first_line
from kubealign.tracking.runs import PARENT_RUN_ENV


def compile_pipeline(config: KubealignConfig, output: Path, env: dict[str, str] | None = None) -> Path:
    """Write the KFP IR YAML of the DAG for `config` (atomically) and return its path."""
    from kfp import compiler

    from kubealign.pipelines.dag import build

    output = output.resolve()
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}.yaml")
    try:
        compiler.Compiler().compile(build(config, env), str(tmp))
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)
    return output


def remote_parent_run(config: KubealignConfig, run_name: str) -> dict[str, str]:
    """Create the parent MLflow run on a reachable tracking server; {} when there is none to reach."""
    from kubealign.tracking.runs import resolve_uri

    uri = resolve_uri(config)  # refuses credentials in the URI
    if not uri or uri.startswith(("sqlite:", "file:")) or "://" not in uri:
        return {}  # a local store here is not the store the cluster's tasks write to
    from mlflow.tracking import MlflowClient

    from kubealign.tracking.runs import resolve_experiment

    try:
        client = MlflowClient(tracking_uri=uri)
        experiment_id = resolve_experiment(client, config.tracking.experiment, None)
        tags = {"kubealign.stage": "pipeline", "kubealign.runner": "kubeflow", **config.feedback.round_tags}
        run_id = client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id
    except Exception as exc:
        raise UserError(f"MLflow tracking at {uri}: {first_line(exc)}") from None
    return {"MLFLOW_EXPERIMENT_ID": experiment_id, PARENT_RUN_ENV: run_id}


def submit(
    config: KubealignConfig,
    host: str,
    experiment: str | None = None,
    run_name: str | None = None,
    namespace: str | None = None,
    enable_caching: bool = True,
    token: str | None = None,
    parent_run: bool = True,
) -> dict[str, Any]:
    """Compile for `config` and create a run on the KFP API at `host`; returns run id, URL, parent run."""
    import kfp

    run_name = run_name or f"kubealign-{time.strftime('%Y%m%d-%H%M%S')}"
    env = remote_parent_run(config, run_name) if parent_run else {}
    with tempfile.TemporaryDirectory(prefix="kubealign-submit-") as tmp:
        package = compile_pipeline(config, Path(tmp) / "pipeline.yaml", env)
        try:
            client = kfp.Client(host=host, namespace=namespace, existing_token=token or os.environ.get("KFP_TOKEN"))
            result = client.create_run_from_pipeline_package(
                str(package),
                arguments={},
                run_name=run_name,
                experiment_name=experiment or config.tracking.experiment,
                namespace=namespace,
                enable_caching=enable_caching,
            )
        except Exception as exc:  # connection refused, 401/403, a rejected spec: one line, not a traceback
            raise UserError(f"KFP API at {host}: {first_line(exc)}") from None
    return {
        "run_id": result.run_id,
        "run_name": run_name,
        "url": f"{host.rstrip('/')}/#/runs/details/{result.run_id}",
        "mlflow_parent_run_id": env.get(PARENT_RUN_ENV),
    }


def upload(config: KubealignConfig, host: str, pipeline_name: str, token: str | None = None) -> dict[str, str]:
    """Compile for `config` and upload it to KFP: a new pipeline, or a new version of an existing one
    (what the Helm chart's upload Job runs on install and upgrade)."""
    import kfp

    version = f"{pipeline_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    with tempfile.TemporaryDirectory(prefix="kubealign-upload-") as tmp:
        package = str(compile_pipeline(config, Path(tmp) / "pipeline.yaml"))
        try:
            client = kfp.Client(host=host, existing_token=token or os.environ.get("KFP_TOKEN"))
            pipeline_id = client.get_pipeline_id(pipeline_name)
            if pipeline_id is None:
                pipeline_id = client.upload_pipeline(package, pipeline_name=pipeline_name).pipeline_id
            client.upload_pipeline_version(package, pipeline_version_name=version, pipeline_id=pipeline_id)
        except Exception as exc:
            raise UserError(f"KFP API at {host}: {first_line(exc)}") from None
    return {"pipeline_id": pipeline_id, "version": version}


def schedule(
    config: KubealignConfig,
    host: str,
    cron: str,
    name: str,
    experiment: str | None = None,
    namespace: str | None = None,
    token: str | None = None,
) -> dict[str, Any]:
    """Compile for `config` and create a KFP recurring run of it (kfp.Client.create_recurring_run): a round of the
    feedback loop on each tick of `cron` (KFP's six-field cron: seconds first). One round at a time
    (max_concurrency 1: a round pulls what the previous one pushed) and no catching up on missed ticks (each
    round pulls whatever people have chosen by then). Caching stays as compiled: the feedback task is never cached,
    so every round reads the newest choices and what follows it reruns when they changed."""
    import kfp

    with tempfile.TemporaryDirectory(prefix="kubealign-schedule-") as tmp:
        package = compile_pipeline(config, Path(tmp) / "pipeline.yaml")
        try:
            client = kfp.Client(host=host, namespace=namespace, existing_token=token or os.environ.get("KFP_TOKEN"))
            found = client.create_experiment(experiment or config.tracking.experiment, namespace=namespace)
            made = client.create_recurring_run(
                found.experiment_id,
                name,
                description=f"kubealign feedback rounds of {config.promote.registered_model} (cron {cron})",
                cron_expression=cron,
                max_concurrency=1,
                no_catchup=True,
                pipeline_package_path=str(package),
            )
        except Exception as exc:
            raise UserError(f"KFP API at {host}: {first_line(exc)}") from None
    recurring = made.recurring_run_id
    return {
        "recurring_run_id": recurring,
        "experiment_id": found.experiment_id,
        "url": f"{host.rstrip('/')}/#/recurringrun/details/{recurring}",
    }
