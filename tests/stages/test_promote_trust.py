"""promote with promote.guards.min_judge_agreement (continuous alignment): promote itself looks up the newest feedback
pull of its registered model in its experiment (kubealign.feedback.lookup.agreement) and the gate stops counting the
checks of a judge people disagree with, then counts them again once a newer pull finds it agreeing. Through the
promote command and a sqlite registry; the feedback runs written as `feedback pull` tags them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.stages.test_promote import aliases, evaluation, promote

pytestmark = pytest.mark.integration
TRUST = ("--set", "promote.guards.min_judge_agreement=0.6")


def pulled(uri: str, experiment: str, reward_agrees: float) -> None:
    """A finished feedback run that checked the training reward model against 20 of people's choices."""
    from mlflow.tracking import MlflowClient

    from kubealign.feedback.lookup import AGREEMENT_TAG

    client = MlflowClient(uri)
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    run = client.create_run(experiment_id, run_name="feedback", tags={AGREEMENT_TAG: "kubealign-actor"})
    client.log_metric(run.info.run_id, "agreement_reward", reward_agrees)
    client.log_metric(run.info.run_id, "agreement_reward_n", 20.0)
    client.set_terminated(run.info.run_id)


def test_promote_reads_the_judges_agreement_and_leans_on_the_trusted_ones(cli, tmp_path: Path):
    from kubealign.config import load_config

    evals, root = tmp_path / "evals", tmp_path / "runs"
    evals.mkdir()
    first = promote(cli, evaluation(evals, "first", win=0.7, gain=0.3, reward=1.0), root / "p1", *TRUST)
    assert first.code == 0 and aliases(root / "p1")["champion"] == 1  # no pull yet: every judge counts
    uri, experiment = f"sqlite:///{root / 'mlflow.db'}", load_config(None, []).tracking.experiment
    pulled(uri, experiment, 0.4)
    # the reward model's win-rate and its champion check fail; people disagree with it, the held-out one (0.75) holds
    lost = evaluation(evals, "lost", win=0.3, gain=0.3, reward=0.9)
    done = promote(cli, lost, root / "p2", *TRUST)
    assert done.code == 0 and aliases(root / "p2")["champion"] == 2
    gate = json.loads((root / "p2" / "result.json").read_text())["gate"]
    why = "[reward agrees with people on 0.40 over 20 tasks, below promote.guards.min_judge_agreement 0.6]"
    assert gate[0] == f"not trusted: win_rate: needs >= 0.5, got 0.300 {why}"
    assert f"not trusted: candidate_reward_mean: needs > 1.000 (the champion's), got 0.900 {why}" in gate
    # a newer pull finds the reward model agreeing with people: its failures count again
    pulled(uri, experiment, 0.9)
    again = promote(cli, evaluation(evals, "again", win=0.3, gain=0.3, reward=0.8), root / "p3", *TRUST)
    assert again.code == 0 and aliases(root / "p3")["champion"] == 2
    assert json.loads((root / "p3" / "result.json").read_text())["gate"][0] == "FAIL: win_rate: needs >= 0.5, got 0.300"


def test_a_reward_model_checked_on_people_s_kept_out_pairs_is_judged_by_its_own_check(cli, tmp_path: Path):
    """evaluate's agreement_reward* (the reward model's check on people's pairs it never trained on: feedback.fresh)
    take the place of the older pull's record: the pull distrusts the reward model (0.40), its own check trusts it
    (0.90 over 12), so its failed win-rate counts and the candidate is refused; without the check it would not."""
    from kubealign.config import load_config

    evals, root = tmp_path / "evals", tmp_path / "runs"
    evals.mkdir()
    assert promote(cli, evaluation(evals, "first", win=0.7, gain=0.3, reward=1.0), root / "p1", *TRUST).code == 0
    uri, experiment = f"sqlite:///{root / 'mlflow.db'}", load_config(None, []).tracking.experiment
    pulled(uri, experiment, 0.4)
    checked = evaluation(evals, "checked", win=0.3, gain=0.3, reward=0.9)
    result = json.loads((checked / "result.json").read_text())
    own = {"agreement_reward": 0.9, "agreement_reward_low": 0.62, "agreement_reward_high": 0.98}
    result["metrics"].update(own, agreement_reward_n=12.0)
    (checked / "result.json").write_text(json.dumps(result))
    done = promote(cli, checked, root / "p2", *TRUST)
    assert done.code == 0 and aliases(root / "p2")["champion"] == 1
    assert json.loads((root / "p2" / "result.json").read_text())["gate"][0] == "FAIL: win_rate: needs >= 0.5, got 0.300"
