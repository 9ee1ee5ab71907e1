"""Config loading: presets, partial files, --set overrides, and errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kubealign.config import KubealignConfig, load_config, preset_names
from kubealign.config.load import apply_override, flatten
from kubealign.errors import UserError
from tests.conftest import REPO


def test_presets_on_disk_are_the_shipped_presets():
    on_disk = sorted(p.stem for p in (REPO / "configs").glob("*.yaml"))
    assert on_disk == preset_names()
    assert {"tiny-cpu", "opt-1.3b-1gpu", "opt-13b-8gpu", "llama2-7b-8gpu"} <= set(on_disk)


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_validates_and_is_headed(name: str):
    path = REPO / "configs" / f"{name}.yaml"
    config = load_config(path)
    assert isinstance(config, KubealignConfig)
    head = path.read_text().split("\n\n")[0]
    for label in ("Purpose:", "Hardware:", "Command:"):
        assert label in head, f"{path.name} header lacks {label}"
    assert load_config(name) == config  # the preset name resolves to the same file


def test_default_is_the_tiny_cpu_preset():
    assert load_config() == load_config(REPO / "configs" / "tiny-cpu.yaml")
    assert load_config().sft.model == "tiny-opt"


def test_partial_file_keeps_defaults(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  seed: 7\n")
    config = load_config(path)
    assert config.data.seed == 7
    assert config.data.split_ratios == (2.0, 4.0, 4.0)
    assert config.ppo.kl_coef == 0.1


def test_set_overrides_nested_typed_values():
    config = load_config(
        None,
        [
            "data.seed=99",
            "data.split_ratios=1,1,2",
            "ppo.hybrid_engine.enabled=false",
            "sft.lora.target_modules=[a, b]",
        ],
    )
    assert config.data.seed == 99
    assert config.data.split_ratios == (1.0, 1.0, 2.0)
    assert config.ppo.hybrid_engine.enabled is False
    assert config.sft.lora.target_modules == ["a", "b"]


def test_apply_override_creates_sections():
    data: dict = {}
    apply_override(data, "ppo.hybrid_engine.max_out_tokens=64")
    assert data == {"ppo": {"hybrid_engine": {"max_out_tokens": 64}}}


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["data.sedd=1"], "field 'data.sedd' (from --set): unknown field"),
        (["data.seed=abc"], "field 'data.seed' (from --set)"),
        (["data.split_ratios=2,4"], "field 'data.split_ratios' (from --set)"),
        (["data.split_ratios=0,0,0"], "positive sum"),
        (
            ["sft.zero_stage=4"],
            "field 'sft.zero_stage' (from --set): Input should be less than or equal to 3",
        ),
        (["sft.lora.only_lora=true"], "sft.lora.only_lora needs sft.lora.r > 0"),
        (["data.seed"], "--set 'data.seed': expected section.key=value"),
        (["seed=1"], "must name a section and a field"),
        (["data.seed.x=1"], "data.seed is not a section"),
    ],
)
def test_bad_overrides_name_the_field(overrides: list[str], expected: str):
    with pytest.raises(UserError) as info:
        load_config(None, overrides)
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


def test_invalid_yaml_names_file_and_line(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text("data:\n  seed: 1\n  sources: [\n")
    with pytest.raises(UserError, match=rf"^{path}:\d+:\d+: invalid YAML"):
        load_config(path)


def test_unknown_section_in_file_names_file_and_field(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("dta:\n  seed: 1\n")
    with pytest.raises(UserError, match=rf"^{path}: field 'dta': unknown field \(did you mean 'data'\?\)$"):
        load_config(path)


def test_a_misspelt_field_gets_the_close_one_of_its_section_and_a_far_off_one_none(cli, tmp_path: Path):
    result = cli("config", "show", "--set", "ppo.kl_cof=0.1")
    assert result.code == 2 and result.out == ""
    assert result.err.strip().splitlines() == [
        "kubealign: error: preset tiny-cpu: field 'ppo.kl_cof' (from --set): unknown field (did you mean 'kl_coef'?)"
    ]
    path = tmp_path / "c.yaml"
    path.write_text("sft:\n  lora:\n    alhpa: 8\n")  # a nested section's own fields
    with pytest.raises(UserError, match=rf"^{path}: field 'sft.lora.alhpa': unknown field \(did you mean 'alpha'\?\)$"):
        load_config(path)
    with pytest.raises(UserError, match=r"^preset tiny-cpu: field 'ppo.zebra' \(from --set\): unknown field$"):
        load_config(None, ["ppo.zebra=1"])


def test_missing_config_lists_presets():
    with pytest.raises(UserError, match="no such file and no such preset .*tiny-cpu"):
        load_config("nope.yaml")


def test_config_show_prints_the_resolved_config(cli):
    result = cli("config", "show", "--set", "data.seed=5")
    assert result.code == 0
    shown = yaml.safe_load(result.out)
    assert shown == load_config(None, ["data.seed=5"]).model_dump(mode="json")
    assert shown["data"]["seed"] == 5


def test_flatten_gives_dotted_params():
    flat = flatten(load_config())
    assert flat["data.seed"] == "1234"
    assert flat["ppo.hybrid_engine.enabled"] == "true"
    assert flat["data.sources"].startswith('[{"path": "synthetic"')


@pytest.mark.parametrize(
    "override",
    [
        "sft.learning_rate=.inf",
        "reward.learning_rate=.nan",
        "ppo.kl_coef=.inf",
        "ppo.cliprange=.nan",
        "ppo.entropy_coef=1e400",
        "sft.weight_decay=.inf",
        "sft.lora.learning_rate=.inf",
        "data.split_ratios=[2,.nan,4]",
    ],
)
def test_non_finite_numbers_are_refused_naming_the_field(cli, tmp_path: Path, override: str):
    """inf passes gt=0 and nan fails no comparison: either would train a NaN model and exit 0."""
    field = override.partition("=")[0].replace("[", "")
    result = cli("sft", "--data", tmp_path / "no-data", "--set", override, "--output", tmp_path / "out")
    lines = result.err.strip().splitlines()
    assert result.code == 2 and len(lines) == 1, result.err
    assert lines[0].startswith(f"kubealign: error: preset tiny-cpu: field '{field}") and "finite number" in lines[0]
    assert "(from --set)" in lines[0] and not (tmp_path / "out").exists()


def test_non_finite_numbers_in_a_file_are_refused_naming_file_and_field(cli, tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("ppo:\n  actor_learning_rate: .inf\n  kl_coef: .nan\n")
    result = cli("sft", "--data", tmp_path / "no-data", "--config", path, "--output", tmp_path / "out")
    lines = result.err.strip().splitlines()
    assert result.code == 2 and len(lines) == 1, result.err
    assert f"{path}: field 'ppo.actor_learning_rate': Input should be a finite number (and 1 more)" in lines[0]


def test_a_route_without_groups_is_refused_before_anything_runs(cli) -> None:
    bad = cli("config", "show", "--set", "pipeline.candidates=[{route: rloo}]", "--set", "ppo.samples_per_prompt=1")
    assert bad.code == 2 and "ppo.samples_per_prompt >= 2" in bad.err and len(bad.err.strip().splitlines()) == 1
    good = cli("config", "show", "--set", "pipeline.candidates=[{route: rloo}]")
    assert good.code == 0, good.err
    assert good.err == ""  # no deprecation line: candidates is the field
    dpo = cli("config", "show", "--set", "pipeline.candidates=[{route: dpo}]", "--set", "ppo.samples_per_prompt=1")
    assert dpo.code == 0, dpo.err  # the ppo task does not run on the dpo route
