"""The chart's MLflow server with authentication on: its config file and its identities.

MLflow's basic-auth app (`mlflow server --app-name basic-auth`) keeps users and permissions in a database
of its own, named in an ini file (MLFLOW_AUTH_CONFIG_PATH). The database URI can hold a password, so the
chart never puts it into a ConfigMap: an init container writes the file from the environment
(`kubealign registry auth-config`, URI from a Secret) into an emptyDir the server reads.

Identities. The server creates the admin from MLFLOW_AUTH_ADMIN_USERNAME / _PASSWORD on its first start.
The chart's identities Job (`kubealign registry identities`) then signs in as that admin and creates the
pipeline, tracker and reader identities (or sets their passwords again: a rotated Secret takes effect on
the next `helm upgrade`). Permissions follow MLflow's rules with default_permission READ: every identity
reads everything; whoever creates an experiment or a registered model gets MANAGE on it, so the pipeline
identity owns what its runs create; moving `champion` needs EDIT on the model, creating a run EDIT on the
experiment. Without credentials a request is 401; the reader's alias move is 403.

The tracker is the identity of the pods that run user code (the reward functions: the ppo task,
evaluate, a judge that only reports; kubealign.cluster.secrets): the Job grants it EDIT on the pipeline's
experiments, so it logs runs there, and READ on the registered models, so it cannot register a version or
move an alias even where it created the model first.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kubealign.errors import UserError, first_line

DEFAULT_PERMISSION = "READ"
# MLflow checks a basic-auth password against its scrypt/PBKDF2 hash (~0.1 s of CPU) two to three times per
# request unless its credential cache is on: with it, authenticated requests cost about what unauthenticated
# ones do (benchmarks/registry_auth_cost.py). The price: the cache is per server worker process (MLflow's
# server runs 4), and a password change or deleted user clears only the cache of the worker that handled it,
# so for up to this long another worker still accepts the old password.
AUTH_CACHE_TTL_S = 60
DATABASE_ENV = "MLFLOW_AUTH_DATABASE_URI"
# The identities the Job creates: (what it is, the variables holding its name and password). The chart fills
# them from each identity's Secret, whose keys are MLflow's own client variables (MLFLOW_TRACKING_USERNAME
# / _PASSWORD), so one Secret is both what a pipeline pod reads and what the Job creates.
IDENTITIES = (
    ("pipeline", "KUBEALIGN_PIPELINE_USERNAME", "KUBEALIGN_PIPELINE_PASSWORD"),
    ("tracker", "KUBEALIGN_TRACKER_USERNAME", "KUBEALIGN_TRACKER_PASSWORD"),
    ("reader", "KUBEALIGN_READER_USERNAME", "KUBEALIGN_READER_PASSWORD"),
)
# What each identity may do on the pipeline's registered models and experiments (claim_models,
# claim_experiments): the pipeline owns both; the tracker logs runs and moves nothing; the reader reads.
MODEL_GRANTS = {"pipeline": "MANAGE", "tracker": "READ", "reader": "READ"}
EXPERIMENT_GRANTS = {"pipeline": "MANAGE", "tracker": "EDIT", "reader": "READ"}


def config_text(database_uri: str, default_permission: str = DEFAULT_PERMISSION) -> str:
    """The basic-auth ini. configparser interpolates `%`, and a URI's escaped password has them (%40):
    doubled here, read back as one. No admin password in the file: the server takes it from the env."""
    uri = database_uri.replace("%", "%%")
    return (
        "[mlflow]\n"
        f"default_permission = {default_permission}\n"
        f"database_uri = {uri}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        f"auth_cache_ttl_seconds = {AUTH_CACHE_TTL_S}\n"
    )


def write_config(path: Path, environ: Mapping[str, str] = os.environ) -> None:
    """Write the ini for the URI in $MLFLOW_AUTH_DATABASE_URI, whole or not at all (tmp file, rename)."""
    uri = environ.get(DATABASE_ENV, "").strip()
    if not uri:
        raise UserError(f"{DATABASE_ENV} is not set: the database of MLflow's users and permissions")
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(config_text(uri), encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:
        raise UserError(f"{path}: {exc.strerror}") from None


def identities(environ: Mapping[str, str] = os.environ) -> dict[str, tuple[str, str]]:
    """{what: (username, password)} of the identities whose variables are set; half of a pair is an error."""
    found = {}
    for what, user_var, password_var in IDENTITIES:
        user, password = environ.get(user_var, ""), environ.get(password_var, "")
        if bool(user) != bool(password):
            missing = password_var if user else user_var
            raise UserError(f"{missing} is not set (the {what} identity needs a username and a password)")
        if user:
            found[what] = (user, password)
    return found


def wait_until_up(tracking_uri: str, wait_s: float, poll_s: float = 2.0) -> None:
    """/health answers 200 (it needs no credentials), or one line after wait_s."""
    import requests

    deadline, last = time.monotonic() + wait_s, "no answer"
    while True:
        try:
            answer = requests.get(f"{tracking_uri.rstrip('/')}/health", timeout=10)
            if answer.status_code == 200:
                return
            last = f"HTTP {answer.status_code}"
        except requests.RequestException as exc:
            last = first_line(exc)
        if time.monotonic() >= deadline:
            raise UserError(f"MLflow at {tracking_uri} is not up after {wait_s:g} s ({last})")
        time.sleep(poll_s)


def ensure(tracking_uri: str, wanted: Mapping[str, tuple[str, str]]) -> list[str]:
    """Create each identity, or set its password again when it exists; signed in as the admin from
    MLFLOW_TRACKING_USERNAME / _PASSWORD. One line per identity saying which it was."""
    from mlflow.exceptions import MlflowException
    from mlflow.server import get_app_client

    client = get_app_client("basic-auth", tracking_uri=tracking_uri)
    done = []
    for what, (user, password) in wanted.items():
        try:
            try:
                client.create_user(user, password)
                done.append(f"{what} identity {user!r} created")
            except MlflowException as exc:
                if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                client.update_user_password(user, password)
                done.append(f"{what} identity {user!r} exists: password set from its Secret")
        except MlflowException as exc:
            raise UserError(f"MLflow at {tracking_uri}, {what} identity {user!r}: {first_line(exc)}") from None
    return done


def claim_models(tracking_uri: str, names: list[str], wanted: Mapping[str, tuple[str, str]]) -> list[str]:
    """Make each registered model (created by the admin when absent) the pipeline identity's (MANAGE) and only
    readable by the tracker and the reader (READ), signed in as the admin. MLflow lets any identity create a
    registered model and gives its creator MANAGE: without this the reader (or a pod holding the tracker)
    could create the pipeline's model on a fresh registry and set `champion`, which the pipeline could then
    not move. One line per model."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri, registry_uri=tracking_uri)

    def create(name: str) -> str:
        client.create_registered_model(name)
        return name  # a registered model's resource id is its name

    return _claim(tracking_uri, "registered model", names, create, str, MODEL_GRANTS, wanted)


def claim_experiments(tracking_uri: str, names: list[str], wanted: Mapping[str, tuple[str, str]]) -> list[str]:
    """Each experiment the pipeline logs to (created by the admin when absent): the pipeline identity's
    (MANAGE), the tracker's to log runs in (EDIT: MLflow's CreateRun needs it), the reader's to read. Creating
    it here also keeps another identity from owning it first. One line per experiment."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)

    def find(name: str) -> str:
        return client.get_experiment_by_name(name).experiment_id

    return _claim(tracking_uri, "experiment", names, client.create_experiment, find, EXPERIMENT_GRANTS, wanted)


def _claim(
    tracking_uri: str,
    kind: str,
    names: list[str],
    create: Callable[[str], str],
    find: Callable[[str], str],
    grants: Mapping[str, str],
    wanted: Mapping[str, tuple[str, str]],
) -> list[str]:
    """Create each `kind` (or find it: its resource id), then give each identity in `wanted` its grant."""
    from mlflow.exceptions import MlflowException
    from mlflow.server import get_app_client

    auth = get_app_client("basic-auth", tracking_uri=tracking_uri)
    resource = kind.replace(" ", "_")  # MLflow's resource types: registered_model, experiment
    done = []
    for name in names:
        try:
            try:
                key, how = str(create(name)), "created"
            except MlflowException as exc:
                if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                key, how = str(find(name)), "exists"
            for what, permission in grants.items():
                if what in wanted:
                    _grant(auth, wanted[what][0], resource, key, permission)
            given = ", ".join(f"{wanted[w][0]} {p}" for w, p in grants.items() if w in wanted)
            done.append(f"{kind} {name!r} {how}: {given}")
        except MlflowException as exc:
            raise UserError(f"MLflow at {tracking_uri}, {kind} {name!r}: {first_line(exc)}") from None
    return done


def _grant(auth: Any, user: str, resource: str, key: str, permission: str) -> None:
    """`permission` on `resource` (registered_model, experiment) `key` for `user`, replacing the grant it had
    (MLflow grants once)."""
    from mlflow.exceptions import MlflowException

    try:
        auth.grant_user_permission(user, resource, key, permission)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        if auth.get_user_permission(user, resource, key).permission != permission:
            auth.revoke_user_permission(user, resource, key)
            auth.grant_user_permission(user, resource, key, permission)
