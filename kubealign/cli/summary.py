"""A one-screen summary of a run: the OUTPUT of `kubealign run` (its run.json names each stage's
directory) or a directory with one subdirectory per stage (the stage commands run by hand)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kubealign.promotion import guards
from kubealign.selection.ranking import standing_name
from kubealign.shape import SHARED
from kubealign.shape import SUMMARY_STAGES as STAGES


def _headline(stage: str, r: dict[str, Any], label: str = "PPO") -> str:
    m = r.get("metrics", {})
    if stage == "data-split":
        prompts = "/".join(
            str(int(sum(m.get(f"{p}_{split}_prompts", 0) for split in ("train", "eval", "heldout"))))
            for p in ("phase1_sft", "phase2_reward", "phase3_prompts")
        )
        return f"{int(m.get('rows_kept', 0))} rows kept; prompts per phase {prompts}"
    if stage == "sft":
        return f"eval perplexity {m['before_perplexity']:.1f} -> {m['after_perplexity']:.1f}"
    if stage == "reward":
        held = f"; held-out model {m['heldout/after_accuracy']:.2f}" if "heldout/after_accuracy" in m else ""
        return f"eval accuracy {m['before_accuracy']:.2f} -> {m['after_accuracy']:.2f}, AUC {m['after_auc']:.3f}{held}"
    if stage == "ppo":
        fns = "".join(
            f", {k.removesuffix('/before')} {m[k]:.2f} -> {m[k.removesuffix('/before') + '/after']:.2f}"
            for k in m
            if k.startswith("fn/") and k.endswith("/before")
        )
        if r.get("algorithm") not in (None, "ppo"):
            return (
                f"{r['algorithm']}: eval reward {m['reward_before']:.3f} -> {m['reward_after']:.3f}{fns}, "
                f"KL {m['kl_after']:.3f}, rollout path {r.get('rollout_path')}"
            )
        target = f" (adaptive target {r['kl_target']})" if r.get("kl_target") is not None else ""
        return (
            f"eval reward {m['reward_before']:.3f} -> {m['reward_after']:.3f}{fns}, KL {m['kl_after']:.3f}"
            f"{target}, rollout path {r.get('rollout_path')}"
        )
    if stage == "dpo":
        return (
            f"eval loss {m['before_loss']:.3f} -> {m['after_loss']:.3f}, implicit-reward accuracy "
            f"{m['after_rewards_accuracy']:.2f}, margin {m['after_rewards_margin']:.2f}, "
            f"KL/token {m['after_kl_per_token']:.3f}"
        )
    if stage == "evaluate":
        return "\n".join(evaluate_lines(m, label))
    if stage == "serve":
        if not r.get("applied"):
            return r.get("why", "nothing applied")
        return f"{r.get('inference_service')} {r.get('action')}: version {r.get('version')}, Ready at {r.get('url')}"
    if stage == "feedback":
        return feedback_lines(m)
    if stage == "judge":  # the verdict line, or why there was nothing to judge
        return r.get("why") or r.get("verdict", "")
    if stage in ("act", "settle"):  # what carrying the verdict out did, or why nothing was done
        return r.get("why") or r.get("summary", "")
    aliases = ", ".join(f"{k}={v}" for k, v in r.get("aliases", {}).items())
    verdict = {1.0: "gate passed", 0.0: "gate refused"}.get(m.get("gate_passed"), "")
    why = f"\n{r['refusal']}" if r.get("refusal") else ""  # the one line naming every failed check
    name, version = r.get("registered_model"), r.get("version")
    audit = (  # how to audit it (docs/pipeline.md): its manifest, and the command that remakes it
        f"\nmodel sha256 {r['model_sha256'][:12]}…, recipe in its provenance.json: kubealign reproduce {name} {version}"
        if r.get("model_sha256")
        else ""
    )
    return f"{name} version {version}; {verdict + '; ' if verdict else ''}{aliases}{why}{audit}"


def feedback_lines(m: dict[str, Any]) -> str:
    """The pull: rows, people's win-rate of the challenger (its interval; weighted where the tasks carry weights)
    and, for pairs pushed from what was served, each judge's agreement with people (kubealign.feedback.agreement)."""
    from kubealign.feedback.agreement import JUDGES

    rate, low, high = (m.get(k, math.nan) for k in ("human_win_rate", "human_win_rate_low", "human_win_rate_high"))
    text = f"{int(m.get('rows', 0))} rows from {int(m.get('decided', 0))} decided tasks"
    if m.get("decided"):
        text += f"; human win-rate {rate:.2f} (95 % {low:.2f}-{high:.2f})"
    if "human_win_rate_weighted" in m:
        text += f", weighted {m['human_win_rate_weighted']:.2f}"
    judges = [
        f"{name} {m[f'agreement_{name}']:.2f} ({m[f'agreement_{name}_low']:.2f}-{m[f'agreement_{name}_high']:.2f}, "
        f"{int(m[f'agreement_{name}_n'])} tasks)"
        for name in JUDGES
        if f"agreement_{name}" in m
    ]
    return text + ("\njudges' agreement with people: " + "; ".join(judges) if judges else "")


def evaluate_lines(m: dict[str, Any], label: str = "PPO") -> list[str]:
    """The evaluation's headline (`label`: how the candidate was trained): rewards, win-rate (with its
    bootstrap lower bound when there is one), KL, and on the synthetic task what its grammar says of the
    samples."""
    bound = f" (95 % lower bound {m['win_rate_lower_bound']:.2f})" if "win_rate_lower_bound" in m else ""
    lines = [
        f"reward {m['baseline_reward_mean']:.3f} (SFT) vs {m['candidate_reward_mean']:.3f} ({label}), "
        f"win-rate {m['win_rate']:.2f}{bound}, ties {m['tie_rate']:.2f}, KL {m['kl_to_baseline']:.3f}"
    ]
    for key in (k for k in m if k.startswith("fn/") and k.endswith("/candidate")):
        name = key.removesuffix("/candidate")
        base = m.get(f"{name}/baseline", float("nan"))
        lines.append(f"{name.removeprefix('fn/')} (reward function): {base:.3f} (SFT) -> {m[key]:.3f} ({label})")
    if "tool_call_rate/candidate" in m:  # evaluated in turns with tools (answers.turns)
        lines.append(
            f"tool calls {m['tool_call_rate/baseline']:.0%} of answers (SFT) -> {m['tool_call_rate/candidate']:.0%} "
            f"({label}), malformed {m['malformed_call_rate/baseline']:.0%} -> {m['malformed_call_rate/candidate']:.0%}"
            f", turns {m['turns_mean/baseline']:.2f} -> {m['turns_mean/candidate']:.2f}"
        )
    if "candidate_preferred_rate" in m:
        lines.append(
            f"preferred answers {m['baseline_preferred_rate']:.0%} (SFT) -> "
            f"{m['candidate_preferred_rate']:.0%} ({label}), "
            f"well formed {m['baseline_well_formed_rate']:.0%} -> {m['candidate_well_formed_rate']:.0%}"
        )
    if "candidate_heldout_logprob" in m and "candidate_distinct_2" in m:  # the promotion guards' main figures
        lines.append(
            f"held-out log-likelihood per token {m['baseline_heldout_logprob']:.3f} (SFT) -> "
            f"{m['candidate_heldout_logprob']:.3f} ({label}), distinct-2 {m['baseline_distinct_2']:.2f} -> "
            f"{m['candidate_distinct_2']:.2f}, repeated bigrams {m['baseline_repetition_rate']:.2f} -> "
            f"{m['candidate_repetition_rate']:.2f}"
        )
    if "heldout_win_rate" in m:  # the independent scorer: a gain it does not see is the signature of hacking
        lines.append(
            f"held-out reward model: win-rate {m['heldout_win_rate']:.2f}, gain {m['heldout_reward_gain']:+.3f} "
            f"(the training one's {m['reward_gain']:+.3f}); the two agree on {m['reward_agreement']:.0%} of the prompts"
        )
    suites = guards.suite_pairs(m)
    if suites:  # evaluate.suites: lm-eval-harness scores of both models
        said = ", ".join(f"{name} {base:.3f} (SFT) -> {cand:.3f} ({label})" for name, (base, cand) in suites.items())
        lines.append(f"suites: {said}")
    return lines


def _result(path: Path) -> dict[str, Any] | None:
    return json.loads((path / "result.json").read_text(encoding="utf-8")) if (path / "result.json").is_file() else None


def _seconds(*results: dict[str, Any] | None) -> str:
    times = [r.get("metrics", {}).get("wall_time_s", r.get("wall_time_s")) for r in results if r]
    times = [t for t in times if isinstance(t, int | float)]
    return f"{sum(times):.1f} s" if times else "-"


def task_seconds(indexed: dict[str, Any], *tasks: str) -> float | None:
    """The tasks' wall time as `kubealign run` measured it (run.json), None where it did not (an older
    run.json, or stages run by hand)."""
    times = [indexed.get("stages", {}).get(task, {}).get("wall_time_s") for task in tasks]
    return sum(times) if times and all(isinstance(t, int | float) for t in times) else None


def route_lines(indexed: dict[str, Any], dirs: dict[str, Path]) -> list[str]:
    """One line per candidate of a several-candidate run, in the comparison's order: its evaluation against
    the SFT model (win-rate with its interval, reward, KL), its registry version and why it did not lead;
    a failed candidate with its error line and log. Time: the candidate's training plus its evaluation."""
    comparison = _result(dirs["compare"]) if "compare" in dirs else None
    if comparison is None:
        return [f"{'compare':<11}{'-':>8}  no comparison (see the failed task above)"]
    took = _time(indexed, "compare", comparison)
    lines = [
        f"{'compare':<11}{took:>8}  {len(comparison['standings'])} candidate(s) ranked by "
        f"{comparison['measure']}, then candidate_reward_mean, then lower kl_to_baseline"
    ]
    if comparison.get("leader", "") is None:  # a KL budget that no candidate kept: the one line why
        lines.append(f"{'':<19}  {comparison['verdict']}")
    leader, front = comparison.get("leader", ""), comparison.get("front", [])
    width = max([9, *(len(standing_name(s)) + 1 for s in comparison["standings"])])
    for standing in comparison["standings"]:
        candidate = standing_name(standing)
        trained, evaluation = _result(dirs[candidate]), _result(dirs[f"evaluate-{candidate}"])
        m = {"win_rate_upper_bound": float("nan"), **(evaluation or {}).get("metrics", {})}
        text = (
            f"win-rate {m['win_rate']:.2f} [{m['win_rate_lower_bound']:.2f}, {m['win_rate_upper_bound']:.2f}], "
            f"reward {m['candidate_reward_mean']:.3f} (SFT {m['baseline_reward_mean']:.3f}), "
            f"KL {m['kl_to_baseline']:.3f}"
        )
        promoted = _result(dirs[f"promote-{candidate}"]) if f"promote-{candidate}" in dirs else None
        if promoted is not None:
            held = ",".join(sorted(a for a, v in promoted.get("aliases", {}).items() if v == promoted.get("version")))
            text += f"; version {promoted.get('version')}{' ' + held if held else ''}"
            if candidate == leader and not promoted.get("metrics", {}).get("gate_passed"):
                text += " (gate refused)"
        if candidate in front and len(comparison["standings"]) > 2:
            text += "; on the frontier"
        if standing["why"]:
            text += f"; behind: {standing['why']}"
        took = task_seconds(indexed, candidate, f"evaluate-{candidate}")
        shown = _seconds(trained, evaluation) if took is None else f"{took:.1f} s"
        lines.append(f"{standing['rank']} {candidate:<{width}}{shown:>8}  {text}")
    for candidate, message in indexed.get("failed_routes", {}).items():
        lines.append(f"- {candidate:<{width}}{'-':>8}  FAILED: {message}")
    return lines


def summarize(run_dir: Path) -> list[str]:
    """Lines: stage, wall time, headline metrics — for every stage whose result.json exists; with several
    routes, the shared stages and then one line per route (route_lines)."""
    lines = [f"{'stage':<11}{'time':>8}  result"]
    index = run_dir / "run.json"
    dirs = {stage: run_dir / stage for stage in STAGES}
    label = "PPO"
    indexed: dict[str, Any] = {}
    if index.is_file():
        indexed = json.loads(index.read_text(encoding="utf-8"))
        dirs.update({k: Path(v["dir"]) for k, v in indexed["stages"].items()})
        label = str(indexed.get("algorithm", "ppo")).upper()
        if len(indexed.get("algorithms", [])) > 1:
            shared = [s for s in SHARED if s in indexed["stages"]]
            return _stage_lines(lines, shared, dirs, label, indexed) + route_lines(indexed, dirs)
    return _stage_lines(lines, STAGES, dirs, label, indexed)


def _time(indexed: dict[str, Any], stage: str, result: dict[str, Any]) -> str:
    """A stage's time: its task's wall time as `kubealign run` measured it (everything the user waited for:
    the process, imports, op builds, every model the stage trained), else the time the stage reported."""
    seconds = task_seconds(indexed, stage)
    if seconds is None:
        seconds = result.get("metrics", {}).get("wall_time_s", result.get("wall_time_s"))
    return f"{seconds:.1f} s" if isinstance(seconds, int | float) else "-"


def _shown(path: Path) -> str:
    """A path as the user can type it from here: relative to the working directory when it lies below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _stage_lines(
    lines: list[str], stages: Any, dirs: dict[str, Path], label: str, indexed: dict[str, Any]
) -> list[str]:
    for stage in stages:
        path = dirs[stage] / "result.json"
        if not path.is_file():
            continue
        result = json.loads(path.read_text(encoding="utf-8"))
        shown = _time(indexed, stage, result)
        first, *more = _headline(stage, result, label).split("\n")
        lines.append(f"{stage:<11}{shown:>8}  {first}")
        lines += [f"{'':<19}  {line}" for line in more]
        page = dirs[stage] / result.get("outputs", {}).get("samples_html", "-")
        if page.is_file():  # the evaluation report: its headline, the verdict, the answers side by side
            lines.append(f"{'':<19}  report: {_shown(page)}")
    return lines
