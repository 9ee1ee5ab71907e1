"""SFT and reward stages on real DeepSpeed engines with tiny models on CPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kubealign.data.tokenize import encode_pair, pad_batch
from kubealign.models import loading
from kubealign.models.value_head import last_token_scores, token_values
from kubealign.training.export import state_sha256
from tests.conftest import NO_TRACKING

pytestmark = pytest.mark.integration
FAST = ["--set", NO_TRACKING]


@pytest.fixture(scope="module")
def split_dir(tmp_path_factory) -> Path:
    from kubealign.cli import main

    out = tmp_path_factory.mktemp("data") / "split"
    assert main(["data-split", "--set", NO_TRACKING, "--output", str(out)]) == 0
    return out


def result_of(directory: Path) -> dict:
    return json.loads((directory / "result.json").read_text())


def kubealign_subprocess(*args: str, env: dict | None = None, launcher: list[str] | None = None):
    exe = [sys.executable, "-m", "kubealign.cli"] if launcher is None else launcher
    # In-process stages of earlier tests left a one-process group's RANK/MASTER_PORT in os.environ.
    launch_vars = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    full_env = {k: v for k, v in os.environ.items() if k not in launch_vars}
    full_env.update(TQDM_DISABLE="1", **(env or {}))
    return subprocess.run([*exe, *map(str, args)], capture_output=True, text=True, env=full_env, timeout=300)


def test_sft_lowers_perplexity_and_exports_a_self_contained_model(cli, split_dir: Path, tmp_path: Path):
    out = tmp_path / "sft"
    result = cli("sft", "--data", split_dir, *FAST, "--output", out)
    assert result.code == 0, result.err
    metrics = result_of(out)["metrics"]
    assert metrics["after_perplexity"] < 0.5 * metrics["before_perplexity"]
    assert metrics["tokens_per_s"] > 0 and metrics["peak_memory_mb"] > 0
    assert not Path(f"{out}.checkpoints").exists()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)  # offline: the dir holds everything
    AutoTokenizer.from_pretrained(out)
    assert (out / "generation_config.json").exists()
    assert state_sha256(model) == result_of(out)["rank_param_sha256"][0]
    assert state_sha256(model) != state_sha256(loading.load_causal_lm("tiny-opt"))


def test_reward_model_learns_the_preference_and_scores_at_the_last_token(cli, split_dir: Path, tmp_path: Path):
    out = tmp_path / "rm"
    result = cli("reward", "--data", split_dir, *FAST, "--output", out)
    assert result.code == 0, result.err
    metrics = result_of(out)["metrics"]
    assert metrics["after_accuracy"] >= 0.95 and metrics["before_accuracy"] < 0.8
    assert metrics["after_margin_mean"] > metrics["before_margin_mean"]
    scores = json.loads((out / "eval_scores.json").read_text())
    assert len(scores["labels"]) == 2 * result_of(out)["eval_pairs"] and scores["tpr"][-1] == 1.0
    # The held-out reward model (issue 53): trained first on phase 2's reserved pairs, none of the main one's,
    # evaluated on the same eval pairs, inside the output as heldout/ (nothing left beside it).
    import datasets

    phase2 = datasets.load_from_disk(str(split_dir / "phase2_reward"))
    held = out / "heldout"
    assert result_of(held)["train_pairs"] == len(phase2["heldout"]) > 0
    assert result_of(out)["train_pairs"] == len(phase2["train"])
    assert not {*phase2["heldout"]["prompt"]} & {*phase2["train"]["prompt"]}
    assert result_of(out)["outputs"]["heldout"] == "heldout" and result_of(held)["eval_pairs"] == len(phase2["eval"])
    assert {k.removeprefix("heldout/"): v for k, v in metrics.items() if k.startswith("heldout/")} == {
        k: v for k, v in result_of(held)["metrics"].items() if isinstance(v, float | int)
    }
    assert metrics["heldout/after_accuracy"] > metrics["heldout/before_accuracy"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rm"]  # no rm.heldout, no checkpoints
    assert (
        load_file(held / "model.safetensors")["score.weight"]
        .ne(load_file(out / "model.safetensors")["score.weight"])
        .any()
    )

    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    tokenizer = loading.load_tokenizer(str(out))
    prompt = "\n\nHuman: Tell me one fact about owls.\n\nAssistant:"
    seqs = [
        encode_pair(tokenizer, prompt, " Of course! Owls hunt at night with sharp hearing.", 64).input_ids,
        encode_pair(tokenizer, prompt, " Go look it up. Owls hunt at night with sharp hearing.", 64).input_ids,
    ]
    with torch.no_grad():
        per_side = {}
        for side in ("right", "left"):
            ids, mask = (torch.tensor(x) for x in pad_batch(seqs, tokenizer.pad_token_id, side))
            per_side[side] = last_token_scores(token_values(model, ids, mask), mask)
        ids, mask = (torch.tensor(x) for x in pad_batch(seqs, tokenizer.pad_token_id))
        hf_pooled = model(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
    assert torch.allclose(per_side["right"], per_side["left"], atol=1e-5)
    assert torch.allclose(per_side["right"], hf_pooled, atol=1e-5)  # HF's own pooling agrees
    assert per_side["right"][0] > per_side["right"][1]  # courteous beats dismissive, same fact


def test_only_lora_changes_only_adapters_and_merged_export_matches(cli, split_dir: Path, tmp_path: Path):
    out = tmp_path / "lora"
    lora = ["sft.lora.r=8", "sft.lora.alpha=16", "sft.lora.only_lora=true", "sft.lora.save_adapter=true"]
    args = [a for item in lora for a in ("--set", item)]
    result = cli("sft", "--data", split_dir, *FAST, *args, "--set", "sft.num_train_epochs=1", "--output", out)
    assert result.code == 0, result.err
    base = load_file(Path(loading.resolve("tiny-opt")) / "model.safetensors")
    merged = load_file(out / "model.safetensors")
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    targets = {"q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"}
    changed = 0
    for name, weight in merged.items():
        module = name.rsplit(".", 2)[-2]
        if module in targets and name.endswith(".weight"):
            prefix = "base_model.model." + name.removesuffix(".weight")
            a, b = adapter[f"{prefix}.lora_A.weight"], adapter[f"{prefix}.lora_B.weight"]
            assert torch.allclose(weight - base[name], (16 / 8) * b @ a, atol=1e-6), name  # W' = W + s*BA
            changed += int(not torch.equal(weight, base[name]))
        else:
            assert torch.equal(weight, base[name]), f"{name} changed under only-LoRA training"
    assert changed > 0

    from peft import PeftModel

    with_adapter = PeftModel.from_pretrained(loading.load_causal_lm("tiny-opt"), out / "adapter").eval()
    plain = loading.load_causal_lm(str(out)).eval()
    ids = torch.tensor(
        [encode_pair(loading.load_tokenizer("tiny-opt"), "\n\nHuman: hi\n\nAssistant:", " Sure", 32).input_ids]
    )
    with torch.no_grad():
        assert torch.allclose(with_adapter(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-5)


def test_zero_stages_give_the_same_first_losses(cli, split_dir: Path, tmp_path: Path):
    firsts = {}
    for stage in (0, 2, 3):
        out = tmp_path / f"z{stage}"
        result = cli(
            "sft",
            "--data",
            split_dir,
            *FAST,
            "--set",
            f"sft.zero_stage={stage}",
            "--set",
            "sft.num_train_epochs=0.15",
            "--output",
            out,
        )
        assert result.code == 0, result.err
        firsts[stage] = [h["train_loss"] for h in result_of(out)["history"][:3]]
    assert len(firsts[0]) == 3
    for stage in (2, 3):
        assert firsts[stage] == pytest.approx(firsts[0], rel=1e-4, abs=1e-4), (stage, firsts)


def launcher(name: str) -> list[str]:
    bin_dir = Path(sys.executable).parent
    if name == "torchrun":  # --standalone: a free rendezvous port per run
        return [str(bin_dir / "torchrun"), "--standalone", "--nproc_per_node", "2", "-m", "kubealign.cli"]
    # The deepspeed launcher on a CPU machine starts 2 local ranks and passes --local_rank=N.
    return [
        str(bin_dir / "deepspeed"),
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        str(bin_dir / "kubealign"),
    ]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.multinode  # several ranks launched by torchrun: the multinode tier (make test-multinode), outside make test
@pytest.mark.parametrize(("launch", "stage"), [("torchrun", "sft"), ("torchrun", "reward"), ("deepspeed", "sft")])
def test_two_ranks_at_zero3_save_one_model(split_dir: Path, tmp_path: Path, launch: str, stage: str):
    out = tmp_path / stage
    torchrun = launcher(launch)
    proc = kubealign_subprocess(
        stage,
        "--data",
        split_dir,
        "--set",
        NO_TRACKING,
        "--set",
        f"{stage}.zero_stage=3",
        "--set",
        f"{stage}.num_train_epochs=0.3",
        "--output",
        out,
        launcher=torchrun,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = result_of(out)
    assert result["metrics"]["world_size"] == 2
    hashes = result["rank_param_sha256"]
    assert len(hashes) == 2 and hashes[0] == hashes[1]
    if stage == "sft":
        assert state_sha256(loading.load_causal_lm(str(out))) == hashes[0]
    else:
        from transformers import AutoModelForSequenceClassification

        assert state_sha256(AutoModelForSequenceClassification.from_pretrained(out)) == hashes[0]
        # the held-out reward model, trained first by the same two ranks, is whole too, and moved in by rank 0
        held = result_of(out / "heldout")["rank_param_sha256"]
        assert len(held) == 2 and held[0] == held[1] != hashes[0]
        assert state_sha256(AutoModelForSequenceClassification.from_pretrained(out / "heldout")) == held[0]
        assert not Path(f"{out}.heldout").exists()


def test_resume_after_sigkill_matches_an_uninterrupted_run(split_dir: Path, tmp_path: Path):
    # length-grouped batches (the default; the tiny preset trains shuffled ones) and two micro-batches a
    # step, so each batch carries its step's token count: the resumed run must rebuild the same plan
    common = [
        "--data",
        split_dir,
        "--set",
        NO_TRACKING,
        "--set",
        "sft.num_train_epochs=0.5",
        "--set",
        "sft.save_every_steps=4",
        "--set",
        "sft.batching=grouped",
        "--set",
        "sft.micro_batch_size=16",
        "--set",
        "sft.gradient_accumulation_steps=2",
    ]
    straight = kubealign_subprocess("sft", *common, "--output", tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-2000:]
    killed = kubealign_subprocess(
        "sft", *common, "--output", tmp_path / "resumed", env={"KUBEALIGN_FAULT_AT_STEP": "6"}
    )
    assert killed.returncode == -9  # SIGKILL: no cleanup ran
    assert not (tmp_path / "resumed").exists()
    assert (tmp_path / "resumed.checkpoints" / "latest").read_text().strip() == "step4"
    resumed = kubealign_subprocess("sft", *common, "--resume", "--output", tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = result_of(tmp_path / "straight"), result_of(tmp_path / "resumed")
    # tiny-cpu: 1170 phase-1 train rows in steps of 2 x 16 = 36 whole steps an epoch; half of it
    assert a["metrics"]["steps"] == b["metrics"]["steps"] == 18
    assert a["metrics"]["padding_share"] < 0.05  # grouped (random batches of 16 here: about 20 %)
    assert [h["train_loss"] for h in a["history"][4:]] == [h["train_loss"] for h in b["history"]]
    assert a["rank_param_sha256"] == b["rank_param_sha256"]
    assert a["metrics"]["after_perplexity"] == b["metrics"]["after_perplexity"]


def test_bad_training_inputs(cli, split_dir: Path, tmp_path: Path):
    cases = [
        (["sft", "--data", tmp_path / "nope"], r"--data .*nope: no such directory"),
        (["sft", "--data", split_dir / "phase3_prompts"], r"is phase3_prompts; this stage trains on phase1_sft"),
        (["reward", "--data", split_dir / "phase1_sft"], r"is phase1_sft; this stage trains on phase2_reward"),
        (
            ["sft", "--data", split_dir, "--set", "sft.micro_batch_size=5000"],
            r"sft\.micro_batch_size: 5000 x 1 rank\(s\) x 1 accumulation step\(s\) is more than",
        ),
        (["sft", "--data", split_dir, "--set", "sft.zero_stage=4"], r"field 'sft\.zero_stage' \(from --set\)"),
        (
            [
                "reward",
                "--data",
                split_dir,
                "--set",
                "reward.lora.r=4",
                "--set",
                "reward.lora.target_modules=[nothing]",
            ],
            r"lora\.target_modules \['nothing'\] match no module",
        ),
    ]
    no_tokenizer = tmp_path / "model-without-tokenizer"
    shutil.copytree(Path(loading.resolve("tiny-opt")), no_tokenizer)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (no_tokenizer / name).unlink()
    cases.append(
        (
            ["sft", "--data", split_dir, "--model", no_tokenizer],
            r"model .*model-without-tokenizer: cannot load tokenizer",
        )
    )
    import re

    for args, pattern in cases:
        out = tmp_path / "out"
        result = cli(*args, *FAST, "--output", out)
        assert result.code == 2, (args, result.err)
        lines = result.err.strip().splitlines()
        assert len(lines) == 1 and re.search(pattern, lines[0]), (args, lines)
        assert not out.exists()


def test_sft_logs_step_metrics_and_the_model_reference_to_mlflow(cli, split_dir: Path, tmp_path: Path):
    from mlflow.tracking import MlflowClient

    from kubealign.tracking.runs import default_store

    out = tmp_path / "sft"
    result = cli(
        "sft",
        "--data",
        split_dir,
        "--set",
        "sft.num_train_epochs=0.3",
        "--set",
        "sft.eval_every_steps=3",
        "--output",
        out,
    )
    assert result.code == 0, result.err
    client = MlflowClient(default_store(tmp_path)[0])
    (run,) = client.search_runs([client.get_experiment_by_name("kubealign-tiny").experiment_id])
    steps = result_of(out)["metrics"]["steps"]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")] == list(range(1, steps + 1))
    ppl_steps = [m.step for m in client.get_metric_history(run.info.run_id, "eval_perplexity")]
    assert ppl_steps == [0, *range(3, steps, 3), steps]  # before, every 3 steps, at the end
    assert run.data.params["sft.learning_rate"] == "0.002"  # the tiny-cpu preset's
    assert run.data.tags["kubealign.model_dir"] == str(out.resolve())
    assert "sft/result.json" in {a.path for a in client.list_artifacts(run.info.run_id, "sft")}
