"""`kubealign judge --champion URL --canary URL --act` (two servers given by hand, as a laptop's round serves them):
the versions it judged are the registry's (the champion alias's and the challenger's, each checked against what its
server lists), written into result.json, where `feedback push --from-judge` reads them to name each task's sides."""

from __future__ import annotations

import json
from pathlib import Path

from tests.stages.test_judge import Completions, judge_config, listing, split  # noqa: F401  (split: the fixture)


def test_judged_by_hand_with_act_names_the_registrys_versions_and_carries_the_verdict_out(
    split: Path,  # noqa: F811
    tmp_path: Path,
    cli,
) -> None:
    from mlflow.tracking import MlflowClient

    from kubealign.models import loading

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    registry = MlflowClient(store, registry_uri=store)
    registry.create_registered_model("kubealign-actor")
    for _ in range(3):
        registry.create_model_version("kubealign-actor", source=tmp_path.as_uri())
    registry.set_registered_model_alias("kubealign-actor", "champion", "2")  # not the newest, not version 1
    registry.set_registered_model_alias("kubealign-actor", "challenger", "3")
    curt = Completions(lambda p: " No, I cannot help.", models=listing("kubealign-actor", "2"))
    courteous = Completions(lambda p: " Certainly! Here it is.", models=listing("kubealign-actor", "3"))
    try:
        config = judge_config(tmp_path)
        base = ["judge", "--config", config, "--prompts", split, "--tokenizer", loading.resolve("tiny-opt")]
        tracked = ["--set", "tracking.enabled=true", "--set", f"tracking.uri={store}"]
        done = cli(
            *base, "--champion", curt.url, "--canary", courteous.url, "--output", tmp_path / "j", "--act", *tracked
        )
        assert done.code == 0, done.err
        result = json.loads((tmp_path / "j" / "result.json").read_text())
        assert result["versions"] == {"champion": "2", "canary": "3"} and result["promoted"]
        assert "judge: challenger (version 3) holds online: promoted to champion" in done.out
        assert result["checks"][:2] == [
            f"pass: champion {curt.url} serves models:/kubealign-actor/2 (the registry's champion)",
            f"pass: canary {courteous.url} serves models:/kubealign-actor/3 (the judged canary)",
        ]
        aliases = registry.get_registered_model("kubealign-actor").aliases
        assert (aliases["champion"], aliases["previous-champion"], "challenger" in aliases) == (3, 2, False)
    finally:
        curt.stop()
        courteous.stop()
