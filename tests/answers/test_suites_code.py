"""evaluate.suites.include_path as an attacker would fill it: lm-eval runs a task's `!function` (and any module it
names) inside the evaluate process, which holds the tracking identity and its environment, and renders its
templates with Jinja. Such suites are refused unless evaluate.suites.allow_code says so, templates render
sandboxed, and the directory's files are pinned by sha256 in the compiled pipeline and evaluate's cache key."""

from __future__ import annotations

from pathlib import Path

import pytest

from kubealign.answers import suites
from kubealign.config.suites import SuitesConfig
from kubealign.errors import UserError

PLAIN = """task: mine
dataset_path: json
dataset_kwargs:
  data_files: {test: /nonexistent.jsonl}
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: answer
"""
# what the probe ran: a credential read and written outside
STEAL = """import os
open(os.environ["KUBEALIGN_PROBE"], "w").write(os.environ.get("AWS_SECRET_ACCESS_KEY", ""))
def load(**kwargs):
    return {}
"""


def include(root: Path, files: dict[str, str]) -> Path:
    root.mkdir()
    for name, text in files.items():
        (root / name).write_text(text, encoding="utf-8")
    return root


def refusal(path: Path, why: str) -> str:
    return (
        f"evaluate.suites.include_path: {path} holds Python ({why}): it would run inside the evaluate process, "
        "with its credentials; set evaluate.suites.allow_code: true to run it"
    )


@pytest.mark.unit
def test_an_include_path_holding_python_is_refused_unless_allowed(tmp_path: Path) -> None:
    assert SuitesConfig().allow_code is False
    tagged = include(tmp_path / "tagged", {"mine.yaml": PLAIN + "custom_dataset: !function os.getcwd\n"})
    module = include(tmp_path / "module", {"mine.yaml": PLAIN, "steal.py": STEAL})
    for root, bad, why in ((tagged, "mine.yaml", "a !function tag"), (module, "steal.py", "a .py file")):
        with pytest.raises(UserError) as refused:
            suites.search_path(SuitesConfig(tasks=["mine"], include_path=str(root)), None)
        assert str(refused.value) == refusal(root / bad, why)
        allowed = SuitesConfig(tasks=["mine"], include_path=str(root), allow_code=True)
        assert suites.search_path(allowed, None)[0] == str(root)
    # a YAML that includes one outside the directory: that one is read too, so it is checked (and pinned)
    outside = include(tmp_path / "outside", {"base.yaml": "custom_dataset: !function steal.load\n"})
    chained = include(tmp_path / "chained", {"mine.yaml": f"include: {outside / 'base.yaml'}\n" + PLAIN})
    with pytest.raises(UserError) as refused:
        suites.search_path(SuitesConfig(tasks=["mine"], include_path=str(chained)), None)
    assert str(refused.value) == refusal(outside / "base.yaml", "a !function tag")
    # plain task YAMLs are not refused
    plain = include(tmp_path / "plain", {"mine.yaml": PLAIN})
    assert suites.search_path(SuitesConfig(tasks=["mine"], include_path=str(plain)), None)[0] == str(plain)


@pytest.mark.integration
def test_the_python_of_a_refused_suite_never_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kubealign.models import loading, tiny

    marker = tmp_path / "stolen"
    monkeypatch.setenv("KUBEALIGN_PROBE", str(marker))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    root = include(
        tmp_path / "evil", {"mine.yaml": PLAIN + "custom_dataset: !function steal.load\n", "steal.py": STEAL}
    )
    path = tiny.ensure("opt")
    model, tokenizer = loading.load_causal_lm(str(path)).eval(), loading.load_tokenizer(str(path))
    with pytest.raises(UserError, match="^evaluate.suites.include_path: .* holds Python"):
        suites.run(SuitesConfig(tasks=["mine"], include_path=str(root)), None, {"baseline": model}, tokenizer)
    assert not marker.exists()


@pytest.mark.unit
def test_templates_render_sandboxed_unless_code_is_allowed() -> None:
    pytest.importorskip("lm_eval")
    from lm_eval import utils

    escape = "{{ cycler.__init__.__globals__.os.getcwd() }}"
    with suites.templates(SuitesConfig()):
        assert utils.apply_template("{{question}}!", {"question": "Why"}) == "Why!"
        with pytest.raises(UserError, match="^evaluate.suites: a task's template reached for Python"):
            suites.rendered(lambda: utils.apply_template(escape, {}))
    with suites.templates(SuitesConfig(allow_code=True)):
        assert utils.apply_template(escape, {})  # lm-eval's own environment, as before


@pytest.mark.kfp
def test_include_path_files_are_pinned_in_the_compiled_pipeline(tmp_path: Path) -> None:
    import yaml

    from kubealign import tasks
    from kubealign.config import config_to_json, load_config
    from kubealign.pipelines.remote import compile_pipeline

    root = include(tmp_path / "mine", {"mine.yaml": PLAIN})
    sets = ["evaluate.suites.tasks=[mine]", f"evaluate.suites.include_path={root}"]

    def evaluate_inputs(label: str, *more: str) -> dict:
        path = compile_pipeline(load_config(None, [*sets, *more]), tmp_path / f"{label}.yaml")
        doc = next(yaml.safe_load_all(path.read_text(encoding="utf-8")))
        return doc["root"]["dag"]["tasks"]["evaluate"]["inputs"]["parameters"]

    first = evaluate_inputs("first")
    pinned = first["suites_fingerprint"]["runtimeValue"]["constant"]
    assert pinned == suites.fingerprint(SuitesConfig(tasks=["mine"], include_path=str(root)), None)
    assert evaluate_inputs("again") == first
    (root / "mine.yaml").write_text(PLAIN.replace("{{question}}", "Q: {{question}}"), encoding="utf-8")
    edited = evaluate_inputs("edited")
    assert edited["suites_fingerprint"] != first["suites_fingerprint"]
    # the task refuses files (or allow_code) other than those compiled, before any model is loaded
    config = load_config(None, sets)
    with pytest.raises(UserError) as refused:
        tasks.evaluate(config_to_json(config), [], "p", "b", "c", "r", str(tmp_path / "out"), "", pinned)
    assert str(refused.value).startswith("evaluate.suites: the include_path files or allow_code are not those")
    # without suites nothing of the user's is read: an empty pin
    assert evaluate_inputs("none", "evaluate.suites.tasks=[]")["suites_fingerprint"]["runtimeValue"]["constant"] == ""
    # code in the include_path is refused at compile time too
    (root / "steal.py").write_text(STEAL, encoding="utf-8")
    with pytest.raises(UserError, match="steal.py holds Python"):
        evaluate_inputs("code")
