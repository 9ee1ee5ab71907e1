"""The rollout engines (ppo.rollout, kubealign.rl.engines): which engine the preflight picks and why, the compiled
decode's exactness on real tiny models (greedy tokens equal to HF eager's after PPO updates, full model and
LoRA; the sampled log-probs equal to the trainer's), and the mismatch bound that stops a run."""

from __future__ import annotations

import pytest
import torch

from kubealign.config.ppo import DEFAULT_MAX_LOGPROB_DIFF, RolloutEngineConfig
from kubealign.config.schema import PPOConfig
from kubealign.errors import UserError
from kubealign.rl import engines, iteration, targets
from kubealign.rl import rollout as rl_rollout
from kubealign.rl.kl import KLController
from tests.rl.test_ppo_reuse import setup
from tests.rl.test_ppo_speed_paths import PROMPT_MASK, PROMPTS, TOKENIZER, tiny_opt

# --- the choice ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("asked", "cuda", "world", "zero", "model_type", "has_vllm", "engine", "says"),
    [
        ("hf", True, 1, 0, "opt", True, "hf", "engine hf"),
        ("compiled", False, 1, 0, "opt", False, "compiled", "static KV cache"),
        ("compiled", True, 2, 3, "opt", True, "hf", "sharded over ranks"),
        ("compiled", True, 2, 2, "llama", True, "compiled", "compiled forward"),  # ZeRO-2 keeps whole weights
        ("compiled", True, 1, 3, "opt", True, "compiled", "compiled forward"),  # one rank: ZeRO-3 holds them all
        ("compiled", True, 1, 0, "gpt2", True, "hf", "not gpt2"),
        ("vllm", False, 1, 0, "opt", False, "hf", "make .venv-vllm"),
        ("vllm", False, 1, 0, "llama", True, "vllm", "vLLM in the trainer's process"),
        ("vllm", True, 1, 0, "gpt2", True, "hf", "not gpt2"),
        ("auto", False, 1, 0, "opt", True, "hf", "auto on CPU"),
        ("auto", True, 1, 0, "opt", True, "vllm", "auto on a GPU: vllm"),
        ("auto", True, 1, 0, "opt", False, "compiled", "auto on a GPU: compiled"),
        ("auto", True, 2, 3, "opt", False, "hf", "compiled: the actor's weights are sharded"),
        ("auto", True, 2, 3, "opt", True, "vllm", "auto on a GPU: vllm"),
    ],
)
def test_the_preflight_picks_an_engine_that_can_run_here_and_says_why(
    asked, cuda, world, zero, model_type, has_vllm, engine, says
):
    choice = engines.choose(asked, cuda, world, zero, model_type, has_vllm)
    assert choice.engine == engine
    assert says in choice.note and "\n" not in choice.note


def test_the_mismatch_bound_applies_to_the_engines_other_than_hf_unless_set():
    assert RolloutEngineConfig().bound("hf") is None
    assert RolloutEngineConfig().bound("compiled") == RolloutEngineConfig().bound("vllm") == DEFAULT_MAX_LOGPROB_DIFF
    assert RolloutEngineConfig(max_logprob_diff=0.5).bound("hf") == 0.5


def test_check_mismatch_stops_only_above_the_bound_and_without_a_filter_in_one_line():
    vllm = PPOConfig(rollout={"engine": "vllm"})
    targets.check_mismatch({"rollout_logprob_diff_mean": DEFAULT_MAX_LOGPROB_DIFF}, vllm, "vllm")  # at the bound
    targets.check_mismatch({"rollout_logprob_diff_mean": 5.0}, PPOConfig(), "hf")  # no bound for hf
    targets.check_mismatch({}, vllm, "vllm")  # nothing measured (multi-turn): nothing to check
    for filtered in ({"top_k": 5}, {"top_p": 0.9}):  # the difference measures the filter: no check
        targets.check_mismatch({"rollout_logprob_diff_mean": 5.0}, PPOConfig(**filtered), "vllm")
    with pytest.raises(UserError) as caught:
        targets.check_mismatch({"rollout_logprob_diff_mean": 0.1001}, vllm, "vllm")
    message = str(caught.value)
    assert "vllm rollout engine" in message and "0.1001 nats" in message and "max_logprob_diff 0.1" in message
    assert "\n" not in message
    with pytest.raises(UserError, match="0.06 nats"):
        targets.check_mismatch({"rollout_logprob_diff_mean": 0.06}, PPOConfig(rollout={"max_logprob_diff": 0.05}), "hf")


# --- the compiled decode, exact -----------------------------------------------------------------------------


def generated(models, cfg: PPOConfig, engine: str):
    models.engine = engine
    torch.manual_seed(0)
    recorder = rl_rollout.SampledLogprobs(rl_rollout.Sampling.of(cfg))
    batch = rl_rollout.generate(models, PROMPTS, PROMPT_MASK, cfg, recorder)
    return batch.input_ids, recorder.actions(batch)


def compiled_graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


GREEDY = {"top_k": 1, "max_new_tokens": 6, "micro_batch_size": 4}  # top-k 1: the argmax, as greedy decoding


def test_compiled_decode_gives_hf_eagers_greedy_tokens_after_ppo_updates_made_with_it():
    sampled = PPOConfig(max_new_tokens=6, micro_batch_size=4, temperature=0.7, rollout={"engine": "compiled"})
    cfg = PPOConfig(**GREEDY)
    models, gen = setup(sampled)
    models.tokenizer, models.rollout = TOKENIZER, rl_rollout.ModuleRollout(models.actor, TOKENIZER, False)
    models.engine = "compiled"
    before = [p.detach().clone() for p in models.actor.module.parameters()]
    graphs = compiled_graphs()
    controller = KLController(0.1)
    for _ in range(3):  # real rollouts with the compiled engine, real updates (plain SGD)
        metrics, _ = iteration.iteration(models, PROMPTS, PROMPT_MASK, sampled, controller, gen)
        assert metrics["rollout_logprob_diff_mean"] < 1e-5  # fp32: the compiled forward computes the trainer's
    assert compiled_graphs() > graphs  # the engine did compile (a setting that did nothing would not)
    moved = [not torch.equal(a, b) for a, b in zip(before, models.actor.module.parameters(), strict=True)]
    assert any(moved)
    ids_compiled, lp_compiled = generated(models, cfg, "compiled")
    ids_hf, lp_hf = generated(models, cfg, "hf")
    assert torch.equal(ids_compiled, ids_hf)
    assert torch.allclose(lp_compiled, lp_hf, atol=1e-5)
    reference_ids = models.actor.module.generate(
        input_ids=PROMPTS, attention_mask=PROMPT_MASK, do_sample=False, max_new_tokens=6, pad_token_id=1, eos_token_id=2
    )
    width = reference_ids.shape[1]  # HF eager stops at every row's EOS as the rollout does
    assert torch.equal(ids_compiled[:, :width], reference_ids)


def test_compiled_decode_with_a_lora_actor_generates_with_the_merged_adapters():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)
    lora = get_peft_model(
        tiny_opt(0), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "fc1"], init_lora_weights=False)
    )
    cfg = PPOConfig(**GREEDY)
    models = models_with(lora)
    ids_compiled, _ = generated(models, cfg, "compiled")
    ids_hf, _ = generated(models, cfg, "hf")
    assert torch.equal(ids_compiled, ids_hf)
    base_only, _ = generated(models_with(tiny_opt(0)), cfg, "hf")
    assert not torch.equal(ids_compiled, base_only)  # the adapters change the answer: they were in the forward
    assert not any(m.merged for m in lora.modules() if hasattr(m, "merged"))  # unmerged after the rollout


def models_with(model):
    actor = torch.nn.Module()
    actor.module = model
    return rl_rollout.PPOModels(actor, None, None, None, rl_rollout.ModuleRollout(actor, TOKENIZER, False), TOKENIZER)


def test_an_engine_sampling_from_other_logits_stops_the_iteration_before_the_update():
    from tests.rl.test_rollout_mismatch import biased

    cfg = PPOConfig(max_new_tokens=6, micro_batch_size=4, rollout={"engine": "compiled", "max_logprob_diff": 0.01})
    models, gen = setup(cfg)
    models.tokenizer, models.rollout = TOKENIZER, rl_rollout.ModuleRollout(models.actor, TOKENIZER, False)
    models.engine = "hf"  # the bound holds whatever the engine once it is set
    handle = models.actor.module.register_forward_hook(biased(3.0))  # the rollout's forwards only (eval mode)
    before = [p.detach().clone() for p in models.actor.module.parameters()]
    with pytest.raises(UserError, match="hf rollout engine's log-probs differ"):
        iteration.iteration(models, PROMPTS, PROMPT_MASK, cfg, KLController(0.1), gen)
    handle.remove()
    assert all(torch.equal(a, b) for a, b in zip(before, models.actor.module.parameters(), strict=True))


def test_the_stage_reports_samples_per_second_and_the_generation_share_of_its_iterations():
    from kubealign.stages.ppo import rates

    # two iterations of 16 samples: 2 + 1 + 1 s (4 samples/s) and 1 + 0.5 + 0.5 s (8 samples/s)
    history = [
        {"generation_time_s": 2.0, "experience_time_s": 1.0, "training_time_s": 1.0, "samples_per_s": 4.0},
        {"generation_time_s": 1.0, "experience_time_s": 0.5, "training_time_s": 0.5, "samples_per_s": 8.0},
    ]
    out = rates(history)
    assert out["samples_per_s"] == pytest.approx(32 / 6)  # 32 samples in 6 s, not the mean of the rates (6)
    assert out["generation_share"] == pytest.approx(3 / 6)


# --- the generation batch against the device's memory -------------------------------------------------------


def test_a_prompts_rollout_memory_is_its_samples_kv_cache_and_response_log_softmax():
    from types import SimpleNamespace

    from kubealign.rl import memory

    opt = SimpleNamespace(num_hidden_layers=24, num_attention_heads=32, hidden_size=2048, vocab_size=50272)
    assert memory.kv_bytes_per_token(opt, "bf16") == 2 * 24 * 32 * 64 * 2  # K and V, 24 layers, 2,048 wide
    gqa = SimpleNamespace(
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, hidden_size=64, vocab_size=10
    )
    assert memory.kv_bytes_per_token(gqa, "fp32") == 2 * 2 * 2 * 8 * 4  # 2 KV heads of 8, not 8 heads
    # 2 samples x (5 tokens x 256 bytes of KV + 2 response tokens x 10 logits x 4 bytes)
    assert memory.prompt_bytes(gqa, "fp32", 3, 2, 2) == 2 * (5 * 256 + 2 * 10 * 4)
    assert memory.fitting_batch(10_000, 2_720) == 2  # 80 % of 10,000 holds two of 2,720, not three
    assert memory.fitting_batch(100, 2_720) == 1
    cfg = PPOConfig(dtype="fp32", max_prompt_len=3, max_new_tokens=2, samples_per_prompt=2, generation_batch_size=2)
    line = memory.note(gqa, cfg, 10_000)
    assert "about 2 would fit (the most that fits)" in line and "\n" not in line
    cfg4 = cfg.model_copy(update={"generation_batch_size": 4})
    assert "(too many: lower it)" in memory.note(gqa, cfg4, 10_000)
