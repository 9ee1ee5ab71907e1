"""PPO on tiny models on CPU: reward rises, LoRA merge equivalence, exact resume, paths, bad inputs."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from kubealign.models import loading
from tests.conftest import NO_TRACKING
from tests.stages.test_training import kubealign_subprocess, result_of
from tests.support.rollout_path import cpu_opt_path

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    """data-split -> a half-trained SFT actor (room for PPO to improve) -> a reward model."""
    from kubealign.cli import main

    root = tmp_path_factory.mktemp("rlhf")
    fast = ["--set", NO_TRACKING]
    assert main(["data-split", *fast, "--output", str(root / "split")]) == 0
    sft = ["--set", "sft.num_train_epochs=6"]
    assert main(["sft", "--data", str(root / "split"), *fast, *sft, "--output", str(root / "sft")]) == 0
    assert main(["reward", "--data", str(root / "split"), *fast, "--output", str(root / "rm")]) == 0
    return {"split": root / "split", "sft": root / "sft", "rm": root / "rm"}


def ppo_args(trained: dict[str, Path], *extra: str) -> list[str]:
    return ["ppo", "--prompts", trained["split"], "--actor", trained["sft"], "--critic", trained["rm"], *extra]


def test_ppo_raises_the_reward_with_the_hybrid_engine(cli, trained, tmp_path: Path):
    out = tmp_path / "ppo"
    args = ["--set", NO_TRACKING, "--set", "ppo.num_iterations=30", "--set", "ppo.actor_learning_rate=3e-4"]
    result = cli(*ppo_args(trained, *args, "--set", "ppo.ema_coef=0.9", "--output", out))
    assert result.code == 0, result.err
    res = result_of(out)
    assert (
        res["rollout_path"] == cpu_opt_path()
    )  # CPU + OPT: the hybrid engine without injection (transformers <= 5.23)
    m = res["metrics"]
    assert m["reward_after"] > m["reward_before"] + 0.2, m
    assert m["kl_after"] > 0 and m["kl_before"] == pytest.approx(0, abs=1e-4)  # the actor starts as the reference
    assert len(res["history"]) == 30
    first = res["history"][0]
    for key in ("policy_loss", "value_loss", "clip_fraction", "approx_kl", "entropy", "explained_variance"):
        assert key in first
    assert first["approx_kl"] >= 0
    # The first minibatch's step reuses the experience pass's forward (ppo.reuse_first_forward): its ratio
    # is 1 by construction, so it is not logged (the tests that measure it turn the reuse off).
    assert not any("approx_kl_first" in h for h in res["history"])
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    actor = AutoModelForCausalLM.from_pretrained(out)
    sft = AutoModelForCausalLM.from_pretrained(trained["sft"])
    assert not torch.equal(actor.model.decoder.layers[0].fc1.weight, sft.model.decoder.layers[0].fc1.weight)
    AutoModelForSequenceClassification.from_pretrained(out / "critic")
    ema = AutoModelForCausalLM.from_pretrained(out / "ema")
    assert not torch.equal(ema.model.decoder.layers[0].fc1.weight, actor.model.decoder.layers[0].fc1.weight)


def test_generation_with_lora_equals_generation_with_merged_weights(trained):
    from peft import LoraConfig, get_peft_model

    from kubealign.rl.rollout import merged_lora

    torch.manual_seed(0)
    model = get_peft_model(
        loading.load_causal_lm(str(trained["sft"])),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "fc1"], init_lora_weights=False),
    ).eval()
    tokenizer = loading.load_tokenizer(str(trained["sft"]))
    batch = tokenizer(["\n\nHuman: Tell me about owls.\n\nAssistant:"], return_tensors="pt")
    kwargs = {"do_sample": False, "max_new_tokens": 12, "pad_token_id": tokenizer.pad_token_id}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        with_adapters = model.generate(**batch, **kwargs)
        with merged_lora(model):
            # What the hybrid engine's kernels read: the base weights only — now with the adapters merged in.
            base_weights = {
                k.replace(".base_layer", ""): v.clone()
                for k, v in model.get_base_model().state_dict().items()
                if "lora_" not in k
            }
        plain = loading.load_causal_lm(str(trained["sft"])).eval()
        plain.load_state_dict(base_weights)
        merged = plain.generate(**batch, **kwargs)
        with model.disable_adapter():
            base_only = model.generate(**batch, **kwargs)
    assert torch.equal(with_adapters, merged)
    assert not torch.equal(with_adapters, base_only)  # the adapters do change the output
    for name, param in model.named_parameters():  # unmerged again afterwards
        assert torch.allclose(param, before[name], atol=1e-6), name


def test_ppo_resume_after_sigkill_matches_an_uninterrupted_run(trained, tmp_path: Path):
    common = [
        *ppo_args(trained),
        "--set",
        NO_TRACKING,
        "--set",
        "ppo.num_iterations=6",
        "--set",
        "ppo.save_every_iterations=2",
    ]
    straight = kubealign_subprocess(*common, "--output", tmp_path / "a")
    assert straight.returncode == 0, straight.stderr[-2000:]
    killed = kubealign_subprocess(*common, "--output", tmp_path / "b", env={"KUBEALIGN_FAULT_AT_STEP": "3"})
    assert killed.returncode == -9 and not (tmp_path / "b").exists()
    resumed = kubealign_subprocess(*common, "--resume", "--output", tmp_path / "b")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = result_of(tmp_path / "a"), result_of(tmp_path / "b")
    assert without_timings(a["history"]) == without_timings(b["history"])
    assert a["rank_param_sha256"] == b["rank_param_sha256"]
    assert a["metrics"]["reward_after"] == b["metrics"]["reward_after"]


TIMINGS = (
    "generation_time_s",
    "experience_time_s",
    "training_time_s",
    "tokens_per_s",
    "samples_per_s",
    "generation_share",
)


def without_timings(history: list[dict]) -> list[dict]:
    """A PPO history without its wall-clock figures: what two runs of the same settings must agree on."""
    return [{k: v for k, v in row.items() if k not in TIMINGS} for row in history]


def test_llama_on_cpu_takes_the_plain_engine_path(cli, trained, tmp_path: Path):
    rm = tmp_path / "llama-rm"
    fast = ["--set", NO_TRACKING, "--set", "reward.num_train_epochs=0.2"]
    assert cli("reward", "--data", trained["split"], "--model", "tiny-llama", *fast, "--output", rm).code == 0
    llama = loading.resolve("tiny-llama")
    out = tmp_path / "ppo"
    args = ["ppo", "--prompts", trained["split"], "--actor", llama, "--critic", rm, "--set", NO_TRACKING]
    result = cli(*args, "--set", "ppo.num_iterations=2", "--output", out)
    assert result.code == 0, result.err
    res = result_of(out)
    assert res["rollout_path"] == "engine"
    # DeepSpeed injects into every transformers LLaMA layer, and this CPU has no inference kernels
    assert "would inject its inference kernels into LlamaDecoderLayer" in res["rollout_notes"][0]
    assert res["rollout_notes"][0].endswith("but DeepSpeed implements no inference kernels on cpu: plain engine")


def test_the_compiled_engine_runs_the_stage_on_the_hybrid_engines_path_and_says_so(cli, trained, tmp_path: Path):
    out = tmp_path / "ppo"
    args = ["--set", NO_TRACKING, "--set", "ppo.num_iterations=2", "--set", "ppo.rollout.engine=compiled"]
    result = cli(*ppo_args(trained, *args, "--output", out))
    assert result.code == 0, result.err
    res = result_of(out)
    assert (res["rollout_path"], res["rollout_engine"]) == (cpu_opt_path(), "compiled")
    assert any("static KV cache" in note for note in res["rollout_notes"])
    for row in res["history"]:  # fp32: the compiled forward samples with the trainer's own log-probs
        assert row["rollout_logprob_diff_mean"] < 1e-5


def test_unsupervised_loss_mix_and_lora_actor_and_critic(cli, trained, tmp_path: Path):
    out = tmp_path / "ptx"
    args = ["--set", NO_TRACKING, "--set", "ppo.num_iterations=2", "--set", "ppo.unsup_coef=0.5"]
    lora = ["--set", "ppo.actor_lora.r=4", "--set", "ppo.critic_lora.r=4", "--set", "ppo.critic_lora.only_lora=true"]
    lora += ["--set", "ppo.actor_lora.dropout=0.5", "--set", "ppo.critic_lora.dropout=0.5"]
    lora += ["--set", "ppo.reuse_first_forward=none"]  # a second forward, to measure the ratio with
    result = cli(*ppo_args(trained, *args, *lora, "--output", out))
    assert result.code == 0, result.err
    history = result_of(out)["history"]
    assert all(h["unsup_loss"] > 0 for h in history)
    # LoRA's own dropout is off too: the first minibatch's ratio is exactly 1
    assert all(h["approx_kl_first"] == 0 and h["clip_fraction_first"] == 0 for h in history)
    from safetensors.torch import load_file

    for path in (out / "model.safetensors", out / "critic" / "model.safetensors"):
        assert not any("lora_" in key for key in load_file(path))  # adapters merged into plain weights


def test_bad_ppo_inputs(cli, trained, tmp_path: Path):
    out = tmp_path / "out"
    split, sft, rm = trained["split"], trained["sft"], trained["rm"]
    empty = tmp_path / "empty-split"
    import datasets

    columns = {"prompt": [], "chosen": [], "rejected": [], "source": [], "origin": []}
    features = datasets.Features({c: datasets.Value("string") for c in columns})
    empty_split = datasets.Dataset.from_dict(columns, features=features)
    datasets.DatasetDict({"train": empty_split, "eval": empty_split}).save_to_disk(
        str(empty / "phase3_prompts"), num_shards={"train": 1, "eval": 1}
    )
    cases = [
        (["--prompts", split, "--actor", tmp_path / "nope", "--critic", rm], r"--actor .*nope: not a model directory"),
        (
            ["--prompts", split, "--actor", rm, "--critic", rm],
            r"--actor .*: is OPTForSequenceClassification, expected a \*ForCausalLM",
        ),
        (
            ["--prompts", split, "--actor", sft, "--critic", sft],
            r"--critic .*: is OPTForCausalLM, expected a \*ForSequenceClassification",
        ),
        (["--prompts", split / "phase1_sft", "--actor", sft, "--critic", rm], r"trains on phase3_prompts"),
        (["--prompts", empty, "--actor", sft, "--critic", rm], r"the phase3_prompts train split is empty"),
        (
            ["--prompts", split, "--actor", sft, "--critic", rm, "--set", "ppo.max_prompt_len=600"],
            r"exceeds the actor's max_position_embeddings 512",
        ),
        (
            ["--prompts", split, "--actor", sft, "--critic", rm, "--set", "ppo.max_new_tokens=100"],
            r"ppo\.hybrid_engine\.max_out_tokens 128 is less than",
        ),
        (
            ["--prompts", split, "--actor", sft, "--critic", rm, "--set", "ppo.generation_batch_size=100000"],
            r"ppo\.generation_batch_size: 100000",
        ),
        (
            ["--prompts", split / "phase3_prompts", "--actor", sft, "--critic", rm, "--set", "ppo.unsup_coef=0.1"],
            r"ppo\.unsup_coef > 0 needs --prompts to be the data-split dir",
        ),
    ]
    import re

    for args, pattern in cases:
        result = cli("ppo", *args, "--set", NO_TRACKING, "--output", out)
        lines = result.err.strip().splitlines()
        assert result.code == 2 and len(lines) == 1 and re.search(pattern, lines[0]), (args, result.err[-500:])
        assert not out.exists()


@pytest.mark.multinode  # several ranks launched by torchrun: the multinode tier (make test-multinode), outside make test
def test_two_ranks_with_torchrun_at_zero3(trained, tmp_path: Path):
    from tests.stages.test_training import launcher

    out = tmp_path / "ppo"
    zero3 = ["--set", "ppo.actor_zero_stage=3", "--set", "ppo.critic_zero_stage=3", "--set", "ppo.num_iterations=3"]
    proc = kubealign_subprocess(
        *ppo_args(trained), "--set", NO_TRACKING, *zero3, "--output", out, launcher=launcher("torchrun")
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = result_of(out)
    assert res["metrics"]["world_size"] == 2 and res["rollout_path"] == cpu_opt_path()
    hashes = res["rank_param_sha256"]
    assert len(hashes) == 2 and hashes[0] == hashes[1]
    from kubealign.training.export import state_sha256

    assert state_sha256(loading.load_causal_lm(str(out))) == hashes[0]


# Seeds at which the filtered log-probs (before commit 16b6cc3) went -inf here: ppo stopped with "actor loss is
# nan" at iteration 11 (seed 1) and 6 (seed 3), grpo at iteration 1 (the preset's seed). Each case runs a
# little past the iteration where it failed (grpo's four answers per prompt make its iterations the dearest).
@pytest.mark.parametrize(("algorithm", "seed", "iterations"), [("ppo", 1, 12), ("ppo", 3, 8), ("grpo", 1234, 3)])
def test_bf16_with_top_k_and_top_p_stays_finite(cli, trained, tmp_path: Path, algorithm, seed, iterations):
    """bf16 with top_k 20 and top_p 0.9: a token at the filter's edge got log-prob -inf when the log-probs
    were recomputed with the filter; now every metric stays finite."""
    out = tmp_path / algorithm
    sets = [
        NO_TRACKING,
        "ppo.dtype=bf16",
        "ppo.top_k=20",
        "ppo.top_p=0.9",
        f"ppo.num_iterations={iterations}",
        f"ppo.algorithm={algorithm}",
        f"ppo.seed={seed}",
    ]
    result = cli(*ppo_args(trained, *(a for s in sets for a in ("--set", s)), "--output", out))
    assert result.code == 0, result.err
    res = result_of(out)
    metrics = {k: v for k, v in res["metrics"].items() if isinstance(v, float)}
    assert metrics and all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["kl_before"] == pytest.approx(0, abs=1e-3)  # the actor starts as the reference
    assert len(res["history"]) == iterations  # past the iteration where it used to stop
    for row in res["history"]:
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), row


def test_a_nan_reward_stops_ppo_naming_the_reward_not_the_learning_rate(cli, trained, tmp_path: Path):
    from transformers import AutoModelForSequenceClassification

    broken = tmp_path / "nan-rm"
    shutil.copytree(trained["rm"], broken)
    model = AutoModelForSequenceClassification.from_pretrained(broken)
    with torch.no_grad():
        model.score.weight.fill_(float("nan"))
    model.save_pretrained(broken)
    out = tmp_path / "ppo"
    result = cli(*ppo_args(trained, "--reward", broken, "--set", NO_TRACKING, "--output", out))
    lines = result.err.strip().splitlines()
    assert result.code == 2 and len(lines) == 1, result.err[-800:]
    assert re.search(
        r"ppo: the reward score is not finite \(nan\) for (\d+) of \1 responses at iteration 1; "
        r"stopped before applying it, no model was written",
        lines[0],
    ), lines[0]
    assert "learning rate" not in lines[0] and not out.exists()


BREVITY_CHECK = """
def brevity(prompts, completions, **columns):
    # a checkable, dense reward: a tenth of a point off per word (SFT's answers run about ten words)
    return [-0.1 * len(c.split()) for c in completions]
"""


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_reward_functions_alone_raise_their_mean(cli, trained, tmp_path: Path, algorithm):
    """No reward model at all (rewards.model_weight 0): the checker is the reward; ppo's critic starts from the
    SFT model. (A sparse 0/1 check of the synthetic grammar's preferred answer, 15 % right after SFT, did not
    rise within 30 iterations here: the reward model's dense score does; benchmarks/verifiable_quality.py
    measures a sparse check on a task made for it.)"""
    (tmp_path / "check.py").write_text(BREVITY_CHECK, encoding="utf-8")
    config = tmp_path / "c.yaml"
    config.write_text("rewards: {model_weight: 0, functions: [{path: check.py:brevity}]}\n", encoding="utf-8")
    out = tmp_path / algorithm
    sets = [NO_TRACKING, f"ppo.algorithm={algorithm}", "ppo.num_iterations=30", "ppo.actor_learning_rate=3e-4"]
    sets += ["ppo.generation_batch_size=8"] if algorithm == "grpo" else []  # 8 prompts x 4 responses
    # ppo: the new value head must learn the returns before its advantages mean much
    sets += ["ppo.critic_learning_rate=1e-3", "ppo.actor_learning_rate=5e-4"] if algorithm == "ppo" else []
    args = [a for s in sets for a in ("--set", s)]
    result = cli(
        "ppo", "--config", config, "--prompts", trained["split"], "--actor", trained["sft"], *args, "--output", out
    )
    assert result.code == 0, result.err
    res = result_of(out)
    m = res["metrics"]
    assert m["fn/brevity/after"] > m["fn/brevity/before"] + 0.2, m  # two words shorter on average
    assert m["reward_before"] == pytest.approx(m["fn/brevity/before"])  # the score is the function alone
    assert all("fn/brevity" in h for h in res["history"])
    assert ("critic" in res["outputs"]) == (algorithm == "ppo")
