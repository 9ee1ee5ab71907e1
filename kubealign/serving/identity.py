"""Which registered version a server serves, read from its /v1/models: the online judge checks it
before it asks a prompt, so that a wrong or swapped URL, or a backend replaced behind one, never gets a
version promoted or rolled back on answers another model gave.

Every model kubealign serves (`kubealign serve` here, the vllm runtime's InferenceService in the cluster)
answers to a second served name, the version's MLflow model URI `models:/NAME/VERSION`; vLLM lists each
served name in /v1/models with the model directory it loaded as `root`. A server matches a version when it
names exactly that one version of the registered model, and the name the judge asks answers with the same
model (the same root) as that version's name. The version is compared whole ("1" is not "11"). A server
that names no model URI at all (KServe's huggingface runtime, the default serve.runtime, cannot take a second
name; a server started by hand) cannot be checked: its line says "unchecked" and the judge goes on, as it did
before the check existed; one that names another version, another model's, or a malformed one is refused.
`problem` and `names_no_version` are pure; `check` reads each server.
"""

from __future__ import annotations

import re
from typing import Any

from kubealign.errors import UserError

PREFIX = "models:/"


def version_name(registered: str, version: str) -> str:
    """The second served name of `version` of `registered`: its MLflow model URI."""
    return f"{PREFIX}{registered}/{version}"


def problem(models: Any, registered: str, version: str, asked: str) -> str | None:
    """None when the /v1/models payload `models` serves `version` of `registered` under the name `asked`;
    else what it serves instead, in words ("serves 'models:/m/3'")."""
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list) or not data or not all(isinstance(m, dict) and "id" in m for m in data):
        return f"lists no served model in /v1/models ({str(models)[:80]})"
    ids = [str(m["id"]) for m in data]
    pattern = re.compile(rf"{re.escape(PREFIX)}{re.escape(registered)}/(\d+)")
    named = sorted({found.group(1) for i in ids if (found := pattern.fullmatch(i))}, key=int)
    if not named:
        return f"serves {', '.join(map(repr, ids))}, naming no version of {registered}"
    if len(named) > 1:
        return f"serves several versions ({', '.join(repr(version_name(registered, v)) for v in named)})"
    if named[0] != version:
        return f"serves {version_name(registered, named[0])!r}"
    if asked not in ids:
        return f"does not answer to {asked!r} (it serves {', '.join(map(repr, ids))})"
    roots = {str(m["id"]): m.get("root") for m in data}
    ours = roots[version_name(registered, version)]
    if roots[asked] != ours:  # the judge's requests would go to another model than the named version
        return f"answers to {asked!r} from {roots[asked]!r}, not from {version_name(registered, version)}'s {ours!r}"
    return None


def names_no_version(models: Any) -> bool:
    """The server lists models but none by a model URI: nothing it says can be checked (not a mismatch)."""
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list) or not data or not all(isinstance(m, dict) and "id" in m for m in data):
        return False
    return not any(str(m["id"]).startswith(PREFIX) for m in data)


def check(urls: dict[str, str], expected: dict[str, str], registered: str, asked: dict[str, str]) -> list[str]:
    """Each server's /v1/models against the version it should serve (urls and expected by role: champion,
    canary); the judge's check lines. One line and nothing judged when one serves another version."""
    from kubealign.serving import ask

    lines = []
    for who, url in urls.items():
        listed = ask.models(url)
        whose = "the registry's champion" if who == "champion" else "the judged canary"
        if names_no_version(listed):
            line = f"unchecked: {who} {url} names no version in /v1/models (serve.runtime vllm does), {whose} is "
            print(f"judge: {line}version {expected[who]}", flush=True)
            lines.append(f"{line}version {expected[who]}")
            continue
        found = problem(listed, registered, expected[who], asked[who])
        if found is not None:
            raise UserError(
                f"judge: {url} {found} but {whose} is version {expected[who]} "
                f"({version_name(registered, expected[who])}); nothing was judged or changed"
            )
        lines.append(f"pass: {who} {url} serves {version_name(registered, expected[who])} ({whose})")
    return lines


def expected_versions(uri: str, registered: str, canary: str) -> dict[str, str]:
    """{champion: the version the champion's server should serve, canary: the judged version}: the registry's
    `champion`, or its `previous-champion` where `champion` is the judged version already (the rerun of a
    promotion carried out in the registry, not yet in serving: the old champion is still served beside it).
    One line when the registry names no such version."""
    from mlflow.tracking import MlflowClient

    from kubealign.promotion.aliases import CHAMPION, PREVIOUS, read_state, registry_errors

    with registry_errors(uri):
        aliases = read_state(MlflowClient(uri), registered)[0]
    alias = PREVIOUS if aliases.get(CHAMPION) == canary else CHAMPION
    if aliases.get(alias) is None:
        raise UserError(f"judge: {registered} has no {alias} alias: no version to check the champion's server against")
    return {"champion": aliases[alias], "canary": canary}


def unchecked(why: str) -> list[str]:
    """The judge's check line when the versions are not checked (no registry read): said, not failed."""
    return [f"unchecked: served versions: {why}"]
