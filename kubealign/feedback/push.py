"""`kubealign feedback push`: two registry aliases answer the same held-out prompts, and the pairs
go to a Label Studio project as pairwise tasks (the sides shuffled per task, the models' identities in the
task's meta only). The project is created with the pairwise template when missing; pushing again adds only
the prompts not in it yet.

The answers are sampled here, from the registered versions' files (downloaded and checked as `kubealign serve`
does), with evaluate's settings and seed: the same answers a serving of those versions would sample."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from kubealign.errors import UserError
from kubealign.feedback import pairs


class Pushed(NamedTuple):
    project: int
    created: bool  # the project was created by this push
    added: int  # tasks added
    present: int  # prompts the project had already


def push_tasks(client: Any, title: str, tasks: list[dict[str, Any]]) -> Pushed:
    """Find or create the project and add the tasks whose prompt it does not have."""
    project = client.find_project(title)
    created = project is None
    if created:
        project = client.create_project(title, pairs.LABEL_CONFIG)
    present = {pairs.task_key(t.get("meta", {}).get("kubealign", {})) for t in client.tasks(project)}
    fresh = pairs.new_tasks(tasks, present)
    added = client.import_tasks(project, fresh) if fresh else 0
    return Pushed(project, created, added, len(tasks) - len(fresh))


def held_out_prompts(where: Path, count: int) -> list[str]:
    """The first `count` prompts of a data-split output's held-out phase-3 prompts (its eval split), or of a
    .jsonl file's rows (their `prompt`)."""
    import json

    if where.suffix == ".jsonl":
        try:
            lines = where.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise UserError(f"--prompts {where}: {exc.strerror}") from None
        prompts = []
        for number, line in enumerate(lines, 1):
            try:
                prompts.append(json.loads(line)["prompt"])
            except (ValueError, KeyError, TypeError):
                raise UserError(f"--prompts {where}:{number}: not a JSON object with a prompt") from None
        return prompts[:count]
    from kubealign.data import phases

    split = phases.load(where, "phase3_prompts")
    rows = split["eval"] if len(split["eval"]) else split["train"]
    return list(rows["prompt"][:count])


def registered_dirs(cfg: Any, tracking_uri: str, name: str, aliases: list[str]) -> list[tuple[Any, Path]]:
    """Each alias's version (serving.location.Served) and its checked HF directory in the cache, as `kubealign
    serve` gets them; one line when the two aliases name one version (nothing to compare)."""
    from mlflow.tracking import MlflowClient

    from kubealign.promotion.aliases import registry_errors
    from kubealign.serving import local, location

    with registry_errors(tracking_uri):
        client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        found = [location.resolve(client, name, alias, tracking_uri) for alias in aliases]
        if found[0].version == found[1].version:
            raise UserError(
                f"--first {aliases[0]} and --second {aliases[1]} are both {name} version {found[0].version}: "
                "nothing to compare"
            )
        dirs = local.verified_copies(found, tracking_uri)  # checked against their manifests, as serve does
    return list(zip(found, dirs, strict=True))


def answers(model_dir: Path, prompts: list[str], config: Any) -> list[str]:
    """The model's answers to the prompts, sampled as evaluate samples (kubealign.answers.sampling: its settings
    and seed; prompts cut as PPO cuts them)."""
    from kubealign.answers.sampling import sample
    from kubealign.data.tokenize import cut_left, encode_prompt
    from kubealign.models import loading

    tokenizer = loading.load_tokenizer(str(model_dir))
    model = loading.load_causal_lm(str(model_dir)).eval()
    cap, bos = config.ppo.max_prompt_len, tokenizer.bos_token_id
    encoded = [cut_left(encode_prompt(tokenizer, p), cap, bos) for p in prompts]
    return [
        tokenizer.decode(r["tokens"], skip_special_tokens=True).strip()
        for r in sample(model, tokenizer, encoded, config.evaluate)
    ]
