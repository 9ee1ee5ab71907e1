"""The `pipeline` section: what the DAG trains (pipeline.candidates), how many at once, the KL budget.

pipeline.candidates is the one field that picks what trains; each candidate names its `route`. Older spellings
are still read, as the same candidates: `pipeline.algorithm: R` (one route) and `pipeline.algorithms: [R, ...]`
(several), one candidate per route, named after it, with no settings (`shorthand`), and a candidate's
`algorithm: R` for its `route: R`; `kubealign.config.load` prints one deprecation line for them (`deprecation`)
where a user's config is loaded, not in the pipeline's tasks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, ValidationError, field_validator, model_validator

from kubealign.config import candidates as sweep
from kubealign.config.base import Section
from kubealign.config.ppo import PPOConfig
from kubealign.config.train import DPOConfig
from kubealign.shape import ROUTES

SHORTHAND = ("algorithm", "algorithms")  # the deprecated spellings of pipeline.candidates
OLD_ROUTE_KEY = "algorithm"  # a candidate's deprecated spelling of its route
_ROUTE: TypeAdapter[str] = TypeAdapter(Literal[ROUTES])
_ROUTE_LIST: TypeAdapter[list[str]] = TypeAdapter(Annotated[list[Literal[ROUTES]], Field(min_length=1)])


class CandidateSpec(Section):
    """One entry of pipeline.candidates: a candidate, or with `sweep` one candidate per point of a grid."""

    name: str | None = Field(
        None,
        description="The candidate's name (its tasks' and MLflow run's); None = the route's. With `sweep`, "
        "the grid points' names start with it: dpo-beta-0p05.",
    )
    route: Literal[ROUTES] = Field(
        description="The candidate's route: ppo, grpo, rloo or dpo (deprecated spelling: `algorithm`)."
    )
    set: dict[str, Any] = Field(
        default_factory=dict,
        description="Settings of the route's training section, dotted as in --set: {dpo.beta: 0.05} for dpo, "
        "{ppo.kl_coef: 0.05} for ppo, grpo and rloo. Only that section: every candidate shares the data, SFT, "
        "reward model and evaluation.",
    )
    sweep: dict[str, list[Any]] = Field(
        default_factory=dict,
        description="A grid: setting -> its values ({dpo.beta: [0.01, 0.05, 0.1]}); one candidate per point of "
        "the product, each with `set` too.",
    )

    @model_validator(mode="before")
    @classmethod
    def _read_algorithm(cls, data: Any) -> Any:
        """A candidate written before `route` had its name: {algorithm: R} is read as {route: R}."""
        if not isinstance(data, Mapping) or OLD_ROUTE_KEY not in data:
            return data
        if "route" in data:
            raise ValueError(f"a candidate sets both route and {OLD_ROUTE_KEY}: keep route")
        read = {key: value for key, value in data.items() if key != OLD_ROUTE_KEY}
        return {**read, "route": data[OLD_ROUTE_KEY]}

    @field_validator("sweep")
    @classmethod
    def _check_sweep(cls, value: dict[str, list[Any]]) -> dict[str, list[Any]]:
        empty = [key for key, values in value.items() if not values]
        if empty:
            raise ValueError(f"sweep {empty[0]}: no values")
        return value


class PipelineConfig(Section):
    """What the DAG runs (`kubealign run`, compile, submit); the stages run alone ignore it."""

    candidates: list[CandidateSpec] | None = Field(
        None,
        min_length=1,
        description="What the DAG trains: the candidates, each a route (ppo, grpo or rloo: the ppo task with "
        "ppo.algorithm set to it; dpo: the dpo task on the phase-2 pairs) with its own settings, a sweep "
        "expanding to several. One candidate: the one-route DAG, whose evaluate and promote take it. Several: all "
        "share the data-split, SFT and reward tasks and the evaluation against the same SFT baseline, a compare "
        "task ranks them, only the leader can become champion. None = one candidate, ppo.algorithm's route "
        "(ppo by default) at its section's settings. Deprecated shorthands, read as this list: "
        "pipeline.algorithm: R = [{route: R}]; pipeline.algorithms: [R, S] = [{route: R}, {route: S}].",
    )
    parallelism: int = Field(
        0,
        ge=0,
        description="At most this many candidates train at once on a cluster (the others wait for a slot); "
        "0 = all at once. kfp.local runs one task at a time anyway.",
    )
    max_kl: float | None = Field(
        None,
        gt=0,
        description="KL budget, nats (evaluate's kl_to_baseline: to the SFT model): the leader is the best "
        "candidate within it; with none within it, nothing is promoted. None = no budget.",
    )

    @field_validator("candidates")
    @classmethod
    def _check_candidates(cls, value: list[CandidateSpec] | None) -> list[CandidateSpec] | None:
        expanded = sweep.expand(spec.model_dump() for spec in value or [])
        sweep.check_names(expanded)
        for candidate in expanded:
            sweep.check_keys(candidate, {"ppo": PPOConfig, "dpo": DPOConfig})
        return value

    def expanded(self) -> list[sweep.Candidate]:
        """pipeline.candidates with every sweep expanded (kubealign.config.candidates.expand)."""
        return sweep.expand(spec.model_dump() for spec in self.candidates or [])


def _valid(adapter: TypeAdapter[Any], field: str, value: Any) -> Any:
    """`value` validated by `adapter`; ValueError naming `field` (and the item) when it is not valid."""
    if value is None:
        return None
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = "".join(f".{part}" for part in err["loc"])
        raise ValueError(f"{field}{where}: {err['msg']}") from None


def shorthand(section: Mapping[str, Any]) -> dict[str, Any]:
    """A `pipeline` section as read (a mapping) with its deprecated spellings read as pipeline.candidates:
    algorithms [R, S] as [{route: R}, {route: S}], algorithm R as [{route: R}] — except ppo, the
    old default, which leaves the route to ppo.algorithm as it always did. ValueError when they conflict
    with each other or with candidates (algorithm ppo conflicts with neither), or name an unknown route."""
    algorithm = _valid(_ROUTE, "pipeline.algorithm", section.get("algorithm"))
    algorithms = _valid(_ROUTE_LIST, "pipeline.algorithms", section.get("algorithms"))
    repeated = sorted({name for name in algorithms or [] if algorithms.count(name) > 1})
    if repeated:
        raise ValueError(f"pipeline.algorithms: each route at most once; repeated: {', '.join(repeated)}")
    chosen = algorithm is not None and algorithm != "ppo"
    if algorithms and chosen:
        raise ValueError(
            f"pipeline.algorithm {algorithm} and pipeline.algorithms both set: keep one "
            "(algorithm is the one-route spelling of algorithms)"
        )
    read = {key: value for key, value in section.items() if key not in SHORTHAND}
    routes = algorithms or ([algorithm] if chosen else [])
    if routes and read.get("candidates") is not None:
        raise ValueError(
            "pipeline.candidates and pipeline.algorithm(s) both set: keep candidates (each names its route)"
        )
    if routes:
        read["candidates"] = [{"route": route} for route in routes]
    return read


def deprecation(section: Mapping[str, Any] | None, routes: Iterable[str]) -> str | None:
    """The one line a config that spells pipeline.candidates the old way gets (None: it does not): the
    fields it used and their exact replacement. `routes`: its candidates' routes, as read."""
    used = [f"pipeline.{key}" for key in SHORTHAND if section and section.get(key) is not None]
    if not used:
        return _old_route_keys(section)
    if section and section.get("candidates") is not None:  # with algorithm ppo, which picks nothing then
        fix = "remove it (pipeline.candidates picks what trains)"
    else:
        fix = "write pipeline.candidates: [" + ", ".join(f"{{route: {route}}}" for route in routes) + "]"
    return f"kubealign: {' and '.join(used)} {'is' if len(used) == 1 else 'are'} deprecated: {fix}"


def _old_route_keys(section: Mapping[str, Any] | None) -> str | None:
    """The line for candidates that name their route `algorithm` (None: none does)."""
    specs = (section or {}).get("candidates")
    old = [i for i, spec in enumerate(specs or []) if isinstance(spec, Mapping) and OLD_ROUTE_KEY in spec]
    if not isinstance(specs, list) or not old:
        return None
    where = ", ".join(f"pipeline.candidates[{i}]" for i in old)
    return f"kubealign: {where}: `{OLD_ROUTE_KEY}` is deprecated: write `route` (same value)"
