"""DPO: the loss against hand-computed values, the frozen reference, and the stage on real DeepSpeed engines."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from kubealign.models import loading
from kubealign.rl.dpo import (
    SequenceLogprobs,
    chosen_nll,
    dpo_loss,
    pair_logprobs,
    reward_metrics,
    sequence_logprobs,
    token_kl,
)
from kubealign.stages import dpo
from kubealign.training.export import state_sha256
from tests.conftest import NO_TRACKING
from tests.stages.test_training import kubealign_subprocess, launcher, result_of

# --- The loss by hand -----------------------------------------------------------------------------------
# Vocabulary of 8, EOS = pad = 7. Two pairs in the project's convention (prompt masked, response + EOS as
# targets, right-padded with the pad = EOS id); pair 0's prompt holds an EOS of its own.
PAIRS = [
    {"prompt": [1, 7, 2], "chosen": [3, 4, 7], "rejected": [0, 7]},
    {"prompt": [2, 1, 1, 3, 4], "chosen": [5, 0, 7], "rejected": [0, 6, 1, 7]},
]
# Rows of the batch: chosen 0 [1 7 2 | 3 4 7], chosen 1 [2 1 1 3 4 | 5 0 7], rejected 0 [1 7 2 | 0 7],
# rejected 1 [2 1 1 3 4 | 0 6 1 7]; width 9. The policy's logits at position t put 1/2 on token (t + 1) % 8
# ("the token at position p is p"), 1/14 on each other; the reference's put 1/2 on token 0, 1/14 elsewhere.
# Response targets (position: token), policy hit = token == position, reference hit = token == 0:
#   chosen 0:   3:3 4:4 5:7       policy 2 hits 1 miss; reference 0 hits 3 misses
#   chosen 1:   5:5 6:0 7:7       policy 2 hits 1 miss; reference 1 hit 2 misses
#   rejected 0: 3:0 4:7           policy 0 hits 2 misses; reference 1 hit 1 miss
#   rejected 1: 5:0 6:6 7:1 8:7   policy 1 hit 3 misses; reference 1 hit 3 misses
HIT, MISS = math.log(1 / 2), math.log(1 / 14)
POLICY = {"c0": 2 * HIT + MISS, "c1": 2 * HIT + MISS, "r0": 2 * MISS, "r1": HIT + 3 * MISS}
REFERENCE = {"c0": 3 * MISS, "c1": HIT + 2 * MISS, "r0": HIT + MISS, "r1": HIT + 3 * MISS}
TOKENS = {"c0": 3, "c1": 3, "r0": 2, "r1": 4}
BETA = 0.1


def hand_batch() -> dict[str, torch.Tensor]:
    def example(prompt: list[int], response: list[int]) -> dict[str, list[int]]:
        return {"input_ids": prompt + response, "loss_mask": [0] * len(prompt) + [1] * len(response)}

    examples = [
        {"index": i, "chosen": example(p["prompt"], p["chosen"]), "rejected": example(p["prompt"], p["rejected"])}
        for i, p in enumerate(PAIRS)
    ]
    return dpo.collate(examples, pad_id=7)


def peaked_logits(guess: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B, T, 8] logits that are log-probabilities: 1/2 on `guess`, 1/14 on each other token."""
    logits = torch.full((*guess.shape, 8), MISS)
    return logits.scatter(-1, guess.unsqueeze(-1), HIT)


def hand_logprobs() -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    batch = hand_batch()
    n, width = batch["input_ids"].shape
    policy = peaked_logits(((torch.arange(width) + 1) % 8).expand(n, width))
    reference = peaked_logits(torch.zeros(n, width, dtype=torch.long))
    return policy, reference, batch


def hand_h(logps: dict[str, float], ref: dict[str, float], pair: int) -> float:
    return (logps[f"c{pair}"] - ref[f"c{pair}"]) - (logps[f"r{pair}"] - ref[f"r{pair}"])


def test_sequence_logprobs_sum_exactly_the_response_tokens():
    policy, reference, batch = hand_logprobs()
    assert batch["input_ids"].shape == (4, 9) and batch["input_ids"][0, 6:].tolist() == [7, 7, 7]
    for logits, expected in ((policy, POLICY), (reference, REFERENCE)):
        seq = sequence_logprobs(logits, batch["input_ids"], batch["loss_mask"])
        want = [expected[k] for k in ("c0", "c1", "r0", "r1")]
        assert seq.total.tolist() == pytest.approx(want, abs=1e-5)
        assert seq.tokens.tolist() == [TOKENS[k] for k in ("c0", "c1", "r0", "r1")]
    # cutting columns that are prompt in every row (what the stage's forward skips) changes nothing
    cut = sequence_logprobs(policy[:, 2:], batch["input_ids"][:, 2:], batch["loss_mask"][:, 2:])
    assert cut.total.tolist() == pytest.approx([POLICY[k] for k in ("c0", "c1", "r0", "r1")], abs=1e-5)


def losses_of(loss_type: str, label_smoothing: float = 0.0):
    policy, reference, batch = hand_logprobs()
    pol = pair_logprobs(sequence_logprobs(policy, batch["input_ids"], batch["loss_mask"]), loss_type)
    ref = pair_logprobs(sequence_logprobs(reference, batch["input_ids"], batch["loss_mask"]), loss_type)
    return dpo_loss(pol[:2], pol[2:], ref[:2], ref[2:], BETA, label_smoothing, loss_type), pol


def test_sigmoid_loss_and_metrics_by_hand():
    h = [hand_h(POLICY, REFERENCE, i) for i in (0, 1)]  # 3 ln 7 and ln 7
    assert h == pytest.approx([3 * math.log(7), math.log(7)])
    out, pol = losses_of("sigmoid")
    want = sum(math.log(1 + math.exp(-BETA * x)) for x in h) / 2  # -log sigmoid(z) = log(1 + e^-z)
    assert float(out.loss) == pytest.approx(want, rel=1e-5)
    metrics = reward_metrics(out, pol[:2], pol[2:])
    chosen = [BETA * (POLICY[f"c{i}"] - REFERENCE[f"c{i}"]) for i in (0, 1)]
    rejected = [BETA * (POLICY[f"r{i}"] - REFERENCE[f"r{i}"]) for i in (0, 1)]
    assert metrics["rewards_chosen"] == pytest.approx(sum(chosen) / 2, rel=1e-5)
    assert metrics["rewards_rejected"] == pytest.approx(sum(rejected) / 2, abs=1e-6)
    assert metrics["rewards_margin"] == pytest.approx(BETA * sum(h) / 2, rel=1e-5)
    assert metrics["rewards_accuracy"] == 1.0
    assert metrics["logps_chosen"] == pytest.approx((POLICY["c0"] + POLICY["c1"]) / 2, rel=1e-5)
    assert metrics["logps_rejected"] == pytest.approx((POLICY["r0"] + POLICY["r1"]) / 2, rel=1e-5)


def test_label_smoothing_is_cdpo_by_hand():
    h = [hand_h(POLICY, REFERENCE, i) for i in (0, 1)]
    out, _ = losses_of("sigmoid", label_smoothing=0.25)
    # -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
    want = sum(0.75 * math.log(1 + math.exp(-BETA * x)) + 0.25 * math.log(1 + math.exp(BETA * x)) for x in h) / 2
    assert float(out.loss) == pytest.approx(want, rel=1e-5)


def test_ipo_uses_per_token_means_by_hand():
    mean_policy = {k: v / TOKENS[k] for k, v in POLICY.items()}
    mean_reference = {k: v / TOKENS[k] for k, v in REFERENCE.items()}
    h = [hand_h(mean_policy, mean_reference, i) for i in (0, 1)]  # (7/6) ln 7 and ln 7 / 3
    assert h == pytest.approx([7 / 6 * math.log(7), math.log(7) / 3])
    out, _ = losses_of("ipo")
    want = sum((x - 1 / (2 * BETA)) ** 2 for x in h) / 2
    assert float(out.loss) == pytest.approx(want, rel=1e-5)


def test_reference_carries_no_gradient_and_equal_models_give_log2():
    policy, _, batch = hand_logprobs()
    policy.requires_grad_(True)
    seq = sequence_logprobs(policy, batch["input_ids"], batch["loss_mask"]).total
    ref = seq.detach().clone().requires_grad_(True)
    out = dpo_loss(seq[:2], seq[2:], ref[:2], ref[2:], BETA)
    assert float(out.loss.detach()) == pytest.approx(math.log(2))  # h = 0: -log sigmoid(0)
    assert reward_metrics(out, seq[:2], seq[2:])["rewards_accuracy"] == 0  # a tie is not a pair ranked right
    out.loss.backward()
    assert ref.grad is None and policy.grad is not None and policy.grad.abs().sum() > 0


def test_rpo_term_is_the_chosen_tokens_mean_nll_by_hand():
    policy, _, batch = hand_logprobs()
    seq = sequence_logprobs(policy, batch["input_ids"], batch["loss_mask"])
    # rows of 3, 3, 2 and 4 tokens: the mean is per token, not a mean of per-response means
    rows = SequenceLogprobs(seq.total[[0, 2, 3]], seq.tokens[[0, 2, 3]])
    want = -(POLICY["c0"] + POLICY["r0"] + POLICY["r1"]) / (TOKENS["c0"] + TOKENS["r0"] + TOKENS["r1"])
    assert float(chosen_nll(rows)) == pytest.approx(want, rel=1e-6)


def test_token_kl_by_hand():
    # KL(policy || reference) per position: 0 where both peak on token 0 (position 7 predicts position 8
    # = 0 mod 8), else 1/2 ln((1/2)/(1/14)) + (1/14) ln((1/14)/(1/2)) = (3/7) ln 7. Rejected 1's last target
    # (position 8) is such a position: 3 of its 4 targets count.
    policy, reference, batch = hand_logprobs()
    kl = token_kl(policy, reference, batch["loss_mask"])
    assert kl.total.tolist() == pytest.approx([n * 3 / 7 * math.log(7) for n in (3, 3, 2, 3)], rel=1e-5)
    assert kl.tokens.tolist() == [3, 3, 2, 4]


def test_token_kl_is_kl_of_the_policy_to_the_reference_not_the_reverse():
    # Row 0 has two targets (positions 1 and 2, predicted at 0 and 1), row 1 is padding. At position 0 the
    # policy is p = [0.7, 0.2, 0.1] and the reference q = [0.2, 0.5, 0.3]: KL(p || q) = 0.5823, while
    # KL(q || p) = 0.5336. At position 1 both are q: 0. The last position predicts nothing.
    p, q = torch.tensor([0.7, 0.2, 0.1]).log(), torch.tensor([0.2, 0.5, 0.3]).log()
    logits = torch.stack([torch.stack([p, q, p]), torch.stack([q, q, q])])  # [2, 3, 3]
    ref_logits = torch.stack([torch.stack([q, q, q]), torch.stack([p, p, p])])
    mask = torch.tensor([[0, 1, 1], [0, 0, 0]])
    kl = token_kl(logits, ref_logits, mask)
    forward = 0.7 * math.log(3.5) + 0.2 * math.log(0.4) + 0.1 * math.log(1 / 3)
    assert kl.total.tolist() == pytest.approx([forward, 0.0], rel=1e-5) and kl.tokens.tolist() == [2, 0]
    reverse = token_kl(ref_logits[:1], logits[:1], mask[:1]).total.item()
    assert reverse == pytest.approx(0.2 * math.log(2 / 7) + 0.5 * math.log(2.5) + 0.3 * math.log(3), rel=1e-5)
    assert abs(forward - reverse) > 0.04


def test_one_token_responses_and_the_defaults_by_hand():
    # ipo's per-token mean and RPO's NLL divide by the token count: 1 token divides by 1.
    one = SequenceLogprobs(torch.tensor([-2.0, -0.5]), torch.tensor([1.0, 1.0]))
    assert pair_logprobs(one, "ipo").tolist() == [-2.0, -0.5] and pair_logprobs(one, "sigmoid").tolist() == [-2.0, -0.5]
    assert float(chosen_nll(SequenceLogprobs(torch.tensor([-3.0]), torch.tensor([1.0])))) == 3.0
    # dpo_loss's defaults are plain DPO (no label smoothing, sigmoid): h = 2 ln 3 at beta 0.5
    out = dpo_loss(torch.tensor([0.0]), torch.tensor([-2 * math.log(3)]), torch.zeros(1), torch.zeros(1), 0.5)
    assert float(out.loss) == pytest.approx(math.log(1 + 1 / 3))  # -log sigmoid(ln 3)
    assert set(reward_metrics(out, torch.zeros(1), torch.zeros(1))) == {
        "loss",
        "rewards_chosen",
        "rewards_rejected",
        "rewards_accuracy",
        "rewards_margin",
        "logps_chosen",
        "logps_rejected",
    }


def test_pairs_follow_the_one_sequence_convention():
    from kubealign.data.tokenize import encode_pair

    tokenizer = loading.load_tokenizer("tiny-opt")
    rows = {
        "prompt": ["\n\nHuman: Tell me about owls.\n\nAssistant:"],
        "chosen": [" Sure! Owls hunt."],
        "rejected": [" No."],
    }
    (pair,) = dpo.tokenize(rows, tokenizer, 64)
    for side in ("chosen", "rejected"):
        enc = encode_pair(tokenizer, rows["prompt"][0], rows[side][0], 64)
        assert pair[side]["input_ids"] == enc.input_ids and enc.input_ids[-1] == tokenizer.eos_token_id
        assert pair[side]["loss_mask"] == [0] * enc.prompt_len + [1] * (len(enc.input_ids) - enc.prompt_len)


# --- The stage ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    """data-split -> a half-trained SFT policy (6 epochs, as test_ppo's) -> a reward model (for evaluate)."""
    from kubealign.cli import main

    root = tmp_path_factory.mktemp("dpo")
    fast = ["--set", NO_TRACKING]
    assert main(["data-split", *fast, "--output", str(root / "split")]) == 0
    sft = ["--set", "sft.num_train_epochs=6"]
    assert main(["sft", "--data", str(root / "split"), *fast, *sft, "--output", str(root / "sft")]) == 0
    assert main(["reward", "--data", str(root / "split"), *fast, "--output", str(root / "rm")]) == 0
    return {"split": root / "split", "sft": root / "sft", "rm": root / "rm"}


@pytest.mark.integration
def test_dpo_raises_the_preferred_rate_keeps_the_reference_and_evaluate_takes_it(cli, trained, tmp_path: Path):
    out = tmp_path / "dpo"
    result = cli("dpo", "--data", trained["split"], "--model", trained["sft"], "--set", NO_TRACKING, "--output", out)
    assert result.code == 0, result.err
    res = result_of(out)
    m = res["metrics"]
    # 405 pairs (phase 2's 540 less its heldout 135) / 8, whole steps
    assert res["stage"] == "dpo" and res["outputs"] == {"model": "."} and m["steps"] == 50
    # the policy starts as the reference: zero implicit rewards, no pair counted right, loss log 2, KL 0
    assert m["before_loss"] == pytest.approx(math.log(2), abs=1e-6) and m["before_rewards_accuracy"] == 0
    assert m["before_kl"] == pytest.approx(0, abs=1e-6)
    assert m["after_loss"] < m["before_loss"] - 0.05 and m["after_rewards_accuracy"] >= 0.9
    assert m["after_rewards_margin"] > 0 and m["after_kl"] > 0
    assert all("rewards_accuracy" in h for h in res["history"])
    # step 1 sees the policy before any update: its implicit rewards against the precomputed reference
    # table are 0 (dropout off, the same sequences; only float noise from another padding width)
    assert abs(res["history"][0]["rewards_chosen"]) < 1e-4 and abs(res["history"][0]["rewards_rejected"]) < 1e-4
    sft_hash = state_sha256(loading.load_causal_lm(str(trained["sft"])))
    reference = res["reference"]
    assert reference["kind"] == "frozen-copy"
    assert reference["sha256_before"] == reference["sha256_after"] == sft_hash  # the reference never trained
    assert res["rank_param_sha256"][0] != sft_hash  # the policy did
    assert not Path(f"{out}.checkpoints").exists()

    evaluation = tmp_path / "eval"
    sets = ["--set", NO_TRACKING, "--set", "evaluate.max_prompts=60"]
    args = ["--prompts", trained["split"], "--baseline", trained["sft"], "--candidate", out, "--reward", trained["rm"]]
    result = cli("evaluate", *args, *sets, "--output", evaluation)
    assert result.code == 0, result.err
    ev = result_of(evaluation)["metrics"]
    # the demo task's preferred behaviour (a courteous, on-topic answer, judged by its grammar) gets commoner
    assert ev["candidate_preferred_rate"] >= ev["baseline_preferred_rate"] + 0.3, ev
    assert ev["candidate_well_formed_rate"] >= 0.9 and ev["win_rate"] > 0.5, ev


@pytest.mark.integration
def test_lora_reference_is_the_same_module_with_adapters_disabled(trained):
    """One module: after steps that moved the adapters, the reference view gives the SFT model's own
    log-probs (and the policy does not); the precomputed table matches the view, pair by pair."""
    from kubealign.config.schema import DPOConfig, LoraConfig
    from kubealign.data import phases
    from kubealign.training import distributed
    from kubealign.training import engine as engines

    distributed.init()
    cfg = DPOConfig(
        model=str(trained["sft"]),
        micro_batch_size=4,
        learning_rate=5e-2,
        lr_scheduler="constant",
        lora=LoraConfig(r=8, only_lora=True),
    )
    assert dpo.build_reference(cfg, 1) is None  # no second copy is ever loaded
    tokenizer = loading.load_tokenizer(cfg.model)
    pairs = dpo.tokenize(phases.load(trained["split"], "phase2_reward")["eval"][:8], tokenizer, 64)
    batch = dpo.collate(pairs[:4], tokenizer.pad_token_id)
    model = engines.apply_lora(loading.load_causal_lm(cfg.model), cfg.lora, "CAUSAL_LM")
    engine = engines.create(model, cfg, engines.ds_config(cfg, 1, False), total_steps=3)
    view = lambda e: dpo.reference_view(e, None)  # noqa: E731
    table = dpo.ReferenceTable(pairs, tokenizer.pad_token_id, 3, view)  # 3: batches of another shape
    for _ in range(3):
        seq = dpo.response_logprobs(engine, batch)
        ref = table.lookup(engine, batch["index"])
        n = len(pairs[:4])
        engine.backward(dpo_loss(seq.total[:n], seq.total[n:], ref[:n], ref[n:], 0.1).loss)
        engine.step()
    sft = loading.load_causal_lm(cfg.model).eval()
    with torch.no_grad():
        base = dpo.response_logprobs(sft, batch).total
        with view(engine) as reference:
            from_view = dpo.response_logprobs(reference, batch).total
        policy = dpo.response_logprobs(engine, batch).total
        full = sequence_logprobs(
            sft(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                position_ids=(batch["attention_mask"].cumsum(-1) - 1).clamp(min=0),
            ).logits,
            batch["input_ids"],
            batch["loss_mask"],
        ).total
    assert torch.allclose(from_view, base, atol=1e-4)
    assert torch.allclose(base, full, atol=1e-4)  # skipping the prompt-only logits changes nothing
    assert (policy - base).abs().max() > 1e-2  # the adapters did move the policy
    assert torch.allclose(table.lookup(engine, batch["index"]), base, atol=1e-4)
    assert engine.module.training  # the view put train mode back
    assert dpo.reference_sha256(engine.module) == state_sha256(sft)


@pytest.mark.integration
def test_lora_run_exports_merged_and_keeps_the_base(cli, trained, tmp_path: Path):
    out = tmp_path / "dpo-lora"
    lora = ["dpo.lora.r=8", "dpo.lora.only_lora=true", "dpo.num_train_epochs=0.2", "dpo.learning_rate=1e-3"]
    sets = [a for item in [NO_TRACKING, *lora] for a in ("--set", item)]
    result = cli("dpo", "--data", trained["split"], "--model", trained["sft"], *sets, "--output", out)
    assert result.code == 0, result.err
    res = result_of(out)
    sft_hash = state_sha256(loading.load_causal_lm(str(trained["sft"])))
    assert res["reference"] == {"kind": "adapters-disabled", "sha256_before": sft_hash, "sha256_after": sft_hash}
    assert state_sha256(loading.load_causal_lm(str(out))) != sft_hash  # the merged adapters moved the export
    assert res["metrics"]["after_rewards_accuracy"] > 0.5 and res["metrics"]["after_kl"] > 0


@pytest.mark.integration
def test_resume_after_sigkill_matches_an_uninterrupted_run(trained, tmp_path: Path):
    common = [
        "--data",
        trained["split"],
        "--model",
        trained["sft"],
        "--set",
        NO_TRACKING,
        "--set",
        "dpo.num_train_epochs=0.15",
        "--set",
        "dpo.save_every_steps=4",
    ]
    straight = kubealign_subprocess("dpo", *common, "--output", tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-2000:]
    killed = kubealign_subprocess(
        "dpo", *common, "--output", tmp_path / "resumed", env={"KUBEALIGN_FAULT_AT_STEP": "6"}
    )
    assert killed.returncode == -9 and not (tmp_path / "resumed").exists()
    assert (tmp_path / "resumed.checkpoints" / "latest").read_text().strip() == "step4"
    resumed = kubealign_subprocess("dpo", *common, "--resume", "--output", tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = result_of(tmp_path / "straight"), result_of(tmp_path / "resumed")
    assert a["metrics"]["steps"] == b["metrics"]["steps"] == 8  # 50 steps an epoch x 0.15, rounded up
    assert a["history"][4:] == b["history"]  # losses and implicit-reward metrics of every later step
    assert a["rank_param_sha256"] == b["rank_param_sha256"]
    assert a["metrics"]["after_loss"] == b["metrics"]["after_loss"]
    # SIGTERM (a preemption) at step 6, checkpoints where --checkpoints says (a task's place on the PVC)
    from tests.stages.test_preemption import stopped_line, term_at

    saved, elsewhere = tmp_path / "pvc" / "dpo", ["--checkpoints", tmp_path / "pvc" / "dpo"]
    stopped = kubealign_subprocess("dpo", *common, *elsewhere, "--output", tmp_path / "term", env=term_at(6))
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    assert stopped.stderr.strip().splitlines()[-1] == stopped_line("dpo", "step 6", saved / "step6")
    assert (saved / "latest").read_text() == "step6" and not (tmp_path / "term.checkpoints").exists()
    resumed = kubealign_subprocess("dpo", *common, *elsewhere, "--resume", "--output", tmp_path / "term")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    c = result_of(tmp_path / "term")
    assert a["history"][6:] == c["history"] and a["rank_param_sha256"] == c["rank_param_sha256"]
    assert not saved.exists()


@pytest.mark.integration
@pytest.mark.multinode  # several ranks launched by torchrun: the multinode tier (make test-multinode), outside make test
@pytest.mark.parametrize("reference", ["frozen-copy", "adapters-disabled"])
def test_two_ranks_at_zero3(trained, tmp_path: Path, reference: str):
    """Partitioned parameters, a reference table each rank fills half of, both kinds of reference."""
    out = tmp_path / "dpo"
    lora = ["dpo.lora.r=8", "dpo.lora.only_lora=true", "dpo.learning_rate=1e-3"] if reference != "frozen-copy" else []
    sets = [a for item in [NO_TRACKING, "dpo.zero_stage=3", "dpo.num_train_epochs=0.2", *lora] for a in ("--set", item)]
    proc = kubealign_subprocess(
        "dpo",
        "--data",
        trained["split"],
        "--model",
        trained["sft"],
        *sets,
        "--output",
        out,
        launcher=launcher("torchrun"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = result_of(out)
    m = res["metrics"]
    assert m["world_size"] == 2 and m["before_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert m["after_loss"] < m["before_loss"]
    assert abs(res["history"][0]["rewards_chosen"]) < 1e-4  # the gathered table matches the policy at step 1
    hashes = res["rank_param_sha256"]
    assert len(hashes) == 2 and hashes[0] == hashes[1]
    sft_hash = state_sha256(loading.load_causal_lm(str(trained["sft"])))
    assert res["reference"] == {"kind": reference, "sha256_before": sft_hash, "sha256_after": sft_hash}


@pytest.mark.integration
def test_bad_dpo_inputs(cli, trained, tmp_path: Path):
    import datasets

    split, sft, rm = trained["split"], trained["sft"], trained["rm"]
    empty = tmp_path / "empty-split"
    columns = {"prompt": [], "chosen": [], "rejected": [], "source": [], "origin": []}
    features = datasets.Features({c: datasets.Value("string") for c in columns})
    empty_split = datasets.Dataset.from_dict(columns, features=features)
    datasets.DatasetDict({"train": empty_split, "eval": empty_split}).save_to_disk(
        str(empty / "phase2_reward"), num_shards={"train": 1, "eval": 1}
    )
    cases = [
        (["--data", split, "--model", rm], r"--model .*rm: is OPTForSequenceClassification, expected a \*ForCausalLM"),
        (["--data", split, "--model", tmp_path / "nope"], r"model .*nope: no such directory"),
        (["--data", split / "phase1_sft", "--model", sft], r"is phase1_sft; this stage trains on phase2_reward"),
        (["--data", empty, "--model", sft], r"the phase2_reward train split is empty"),
        (["--data", split, "--model", sft, "--set", "dpo.lora.r=4"], r"field 'dpo'.*only_lora: true"),
        (["--data", split, "--model", sft, "--set", "dpo.loss_type=hinge"], r"dpo\.loss_type"),
        (
            ["--data", split, "--model", sft, "--set", "dpo.loss_type=ipo", "--set", "dpo.label_smoothing=0.1"],
            r"label_smoothing applies to loss_type sigmoid",
        ),
        (["--data", split, "--model", sft, "--set", "dpo.beta=0"], r"dpo\.beta"),
        (["--data", split, "--model", sft, "--set", "dpo.micro_batch_size=5000"], r"dpo\.micro_batch_size: 5000"),
    ]
    out = tmp_path / "out"
    for args, pattern in cases:
        result = cli("dpo", *args, "--set", NO_TRACKING, "--output", out)
        lines = result.err.strip().splitlines()
        assert result.code == 2 and len(lines) == 1 and re.search(pattern, lines[0]), (args, result.err[-500:])
        assert not out.exists()


@pytest.mark.integration
def test_tasks_train_runs_dpo(trained, tmp_path: Path):
    """What the DAG's dpo component calls: kubealign.tasks.train("dpo", config_json, overrides, data, sft dir, out)."""
    from kubealign import tasks
    from kubealign.config import config_to_json, load_config

    config_json = config_to_json(load_config(None, [NO_TRACKING]))
    overrides = ["dpo.num_train_epochs=0.05"]
    result = tasks.train("dpo", config_json, overrides, str(trained["split"]), str(trained["sft"]), str(tmp_path / "d"))
    assert result["stage"] == "dpo" and result["base_model"] == str(trained["sft"]) and result["metrics"]["steps"] == 3
