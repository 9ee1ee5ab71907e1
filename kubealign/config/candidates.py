"""The candidates of one pipeline run (pipeline.candidates): each a name, a route and settings of that
route's training section, e.g. {name: dpo-beta-0p05, route: dpo, set: {dpo.beta: 0.05}}.

Pure functions, no pydantic: expand sweep grids into named candidates, derive names that are safe as KFP
task names and MLflow run names, and check that every setting names a field of the route's section (the
values themselves are validated by building each candidate's config, kubealign.config.schema).

Why names are restricted: a candidate's name becomes its tasks' names (NAME, evaluate-NAME,
promote-NAME, wait-NAME), which KFP sanitizes into Kubernetes names: two names that sanitize alike would
collide, so only what needs no sanitizing is accepted (lowercase letters, digits, hyphens).
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from kubealign.shape import RESERVED_TASKS, ROUTE_TASK_KEYS, ROUTES, WAIT_PREFIX

MAX_CANDIDATES = 16  # the compare task declares this many evaluation inputs (a KFP component's inputs are fixed)
TASK_PREFIXES = (*(prefix for prefix, _ in ROUTE_TASK_KEYS if prefix), WAIT_PREFIX)  # evaluate-, promote-, wait-
NAME = re.compile(r"^[a-z]([a-z0-9-]{0,38}[a-z0-9])?$")  # <= 40 characters: promote-NAME stays a DNS label


class Candidate(NamedTuple):
    """One branch of the DAG: `route` trained with `settings` (dotted keys of its section -> values)."""

    name: str
    route: str
    settings: Mapping[str, Any]

    def overrides(self) -> list[str]:
        return as_overrides(self.settings)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "route": self.route, "set": dict(self.settings)}

    @classmethod
    def from_dict(cls, given: Mapping[str, Any]) -> Candidate:
        """as_dict's inverse; a dict written before the route had its name holds it as "algorithm" (a run
        index or a compiled pipeline of an earlier release, read again by `kubealign rerun`)."""
        return cls(given["name"], given["route"] if "route" in given else given["algorithm"], given.get("set") or {})


def as_overrides(settings: Mapping[str, Any]) -> list[str]:
    """Settings as --set overrides (JSON values are YAML, which the override parser reads)."""
    return [f"{key}={json.dumps(value)}" for key, value in settings.items()]


def section_of(route: str) -> str:
    """The config section a route's candidates may set: dpo's, or ppo's for ppo, grpo and rloo."""
    return "dpo" if route == "dpo" else "ppo"


def slug(value: Any) -> str:
    """A value as a name part: 0.05 -> 0p05, 1e-05 -> 1e-05, True -> true, [a, b] -> a-b."""
    text = value if isinstance(value, str) else json.dumps(value)
    text = text.lower().replace(".", "p")
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-")


def setting_label(key: str) -> str:
    """The last part of a dotted key, as a name part: dpo.beta -> beta, ppo.kl_coef -> kl-coef."""
    return slug(key.rsplit(".", 1)[-1])


def expand(specs: Iterable[Mapping[str, Any]]) -> list[Candidate]:
    """Each spec ({name?, route, set?, sweep?}) as one candidate, or one per point of its sweep grid
    (the product of the sweep's value lists, in the order written). A grid point's name is the spec's name
    (default: the route) followed by each swept setting's label and value: dpo-beta-0p05."""
    out = []
    for spec in specs:
        route, fixed = spec["route"], dict(spec.get("set") or {})
        sweep = dict(spec.get("sweep") or {})
        base = spec.get("name") or route
        if not sweep:
            out.append(Candidate(base, route, fixed))
            continue
        for point in itertools.product(*sweep.values()):
            chosen = dict(zip(sweep, point, strict=True))
            parts = (f"{setting_label(key)}-{slug(value)}" for key, value in chosen.items())
            out.append(Candidate("-".join((base, *parts)), route, {**fixed, **chosen}))
    return out


def check_names(candidates: list[Candidate]) -> None:
    """ValueError naming the first name that is unsafe, reserved, repeated or another route's; or too many."""
    if len(candidates) > MAX_CANDIDATES:
        raise ValueError(f"{len(candidates)} candidates; at most {MAX_CANDIDATES} in one run")
    seen: set[str] = set()
    for c in candidates:
        if not NAME.match(c.name):
            raise ValueError(
                f"candidate name {c.name!r}: use lowercase letters, digits and hyphens, starting with a letter, "
                "at most 40 characters (it names the candidate's tasks and MLflow run)"
            )
        if c.name in RESERVED_TASKS or c.name.startswith(TASK_PREFIXES):
            raise ValueError(f"candidate name {c.name!r} is taken by the DAG's own tasks; choose another")
        if c.name in ROUTES and c.name != c.route:
            raise ValueError(f"candidate name {c.name!r} is another route's; a {c.route} candidate needs another")
        if c.name in seen:
            raise ValueError(f"candidate name {c.name!r} is used twice; give one a `name`")
        seen.add(c.name)


def check_keys(candidate: Candidate, fields_of: Mapping[str, Any]) -> None:
    """ValueError naming the first setting that is not a field of the route's section. fields_of: section
    name -> its pydantic model class (nested sections are walked through their fields' classes)."""
    section = section_of(candidate.route)
    for key in candidate.settings:
        head, _, rest = key.partition(".")
        if head != section or not rest:
            raise ValueError(
                f"candidate {candidate.name}: setting {key!r}: a {candidate.route} candidate sets {section}.<field>"
            )
        if key == "ppo.algorithm":
            raise ValueError(f"candidate {candidate.name}: ppo.algorithm is the candidate's `route`")
        model = fields_of[section]
        for part in rest.split("."):
            fields = getattr(model, "model_fields", {})
            if part not in fields:
                raise ValueError(f"candidate {candidate.name}: {key} is not a setting of {section} (no field {part!r})")
            model = fields[part].annotation
