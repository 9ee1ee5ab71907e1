"""`evaluate.suites`: benchmark suites through lm-eval-harness, the baseline and the candidate on each (the
suites guard, docs/guards.md).

lm-eval-harness (EleutherAI's, the library the Kubeflow pipelines-components' evaluation component runs) scores
both models on the named tasks, in the evaluate task; promote.guards.max_suite_drop bounds how far the
candidate may fall below the baseline on any of them. Off by default (no task named): real suites need real
models and their data on the pod. kubealign ships one small task for the embedded data, `kubealign_facts`
(multiple choice on the synthetic facts, kubealign/data/suites/); docs/guards.md says how to point this at
real suites.

An include_path is user code when it holds Python: lm-eval imports a task's `!function` module inside the
evaluate process. Such a directory is refused unless `allow_code` says so, and its files are pinned by sha256 in
the compiled pipeline (kubealign.answers.suites.fingerprint).
"""

from __future__ import annotations

from pydantic import Field, field_validator

from kubealign.config.base import Section

SHIPPED = "kubealign_facts"  # the task kubealign ships (kubealign/data/suites/kubealign_facts.yaml)


class SuitesConfig(Section):
    tasks: list[str] = Field(
        default_factory=list,
        description=f"lm-eval task (or group) names to score both models on, e.g. [{SHIPPED}] or [hellaswag, "
        "arc_easy]; empty = no suites (the default).",
    )
    include_path: str | None = Field(
        None,
        description="A directory of your own lm-eval task YAML files, read besides kubealign's (relative to the "
        "config file's directory; on a cluster, a path the evaluate pod can read: the PVC or your image). "
        "None = kubealign's shipped tasks and lm-eval's own.",
    )
    allow_code: bool = Field(
        False,
        description="Run the Python a task in include_path brings (a .py file, a YAML `!function` tag, a template "
        "that reaches Python objects). false (the default): such an include_path is refused in one line naming "
        "the file and templates render in Jinja's sandbox. true: that code runs inside the evaluate process, with "
        "its environment and credentials (the tracking identity, MLFLOW_TRACKING_PASSWORD) and its network and "
        "files; only for task files you would run as evaluate yourself. kubealign's own tasks need no allowing.",
    )
    metric: str = Field(
        "acc",
        min_length=1,
        description="The metric read from each task's results (lm-eval's name, e.g. acc, acc_norm, exact_match); "
        "a task that does not report it is refused by name.",
    )
    limit: int | None = Field(
        None, ge=1, description="At most this many documents of each task (the first ones); None = all."
    )
    num_fewshot: int | None = Field(None, ge=0, description="Few-shot examples per question; None = each task's own.")
    batch_size: int = Field(8, ge=1, description="Requests per forward pass.")

    @field_validator("tasks")
    @classmethod
    def _check_tasks(cls, value: list[str]) -> list[str]:
        blank = [i for i, name in enumerate(value) if not name.strip()]
        if blank:
            raise ValueError(f"task {blank[0]} is empty")
        if len(set(value)) != len(value):
            raise ValueError(f"a task is named twice: {value}")
        return value
