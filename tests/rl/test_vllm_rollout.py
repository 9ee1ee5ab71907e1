"""The colocated vLLM rollout engine (kubealign/rl/vllm_rollout.py, issue 76) against transformers on tiny fp32
models: greedy tokens and the whole RolloutBatch equal HF generate's, before and after the weights change (a
few optimizer steps, a LoRA adapter), its log-probs equal the trainer's, the layout is HybridEngineRollout's,
stop text ends a response, and sampling repeats under the same seed.

Runs in the trainer venv with vLLM (make test-vllm-rollout: .venv-vllm from requirements/lock-vllm.txt); skips
without vllm. One engine per architecture for the module (start-up is the expensive part); every test loads
the weights it means into it first."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch

pytestmark = pytest.mark.vllm_rollout
pytest.importorskip("vllm", reason="needs vLLM: the .venv-vllm environment (make test-vllm-rollout)")

from deepspeed.runtime.rollout import RolloutRequest, SamplingConfig  # noqa: E402

from kubealign.models import tiny  # noqa: E402
from kubealign.models.token_logprobs import forward_logits  # noqa: E402
from kubealign.rl.vllm_rollout import VLLMRollout, vllm_name  # noqa: E402

STOP = "</tool_call>"
LOGPROB_TOLERANCE = 1e-3  # fp32 on both sides: vLLM's CPU kernels and HF's SDPA round differently, ~1e-5 here
# What the trained model learns to answer (train()): rows that end at EOS at different lengths, and one that
# closes a tool call and then goes on.
LESSONS = [
    ("Human: what is two plus two? Assistant:", " four"),
    ("Human: name a colour. Assistant:", " blue or red"),
    ("Human: call the tool. Assistant:", " <tool_call>add two" + STOP + " then more words"),
]


STARTED: dict[str, dict[str, bool]] = {}  # what each engine's start-up left of the trainer's process state


@dataclass
class Settings:
    vllm_memory: float = 0.3
    vllm_sleep: bool = True
    vllm_kv_cache_gib: float = 1.0


@pytest.fixture(scope="module", params=["llama", "opt"])
def setup(request):
    """(engine, tokenizer, model dir, start-up seconds) for one tiny architecture."""
    from transformers import AutoTokenizer

    path = tiny.ensure(request.param)
    tokenizer = AutoTokenizer.from_pretrained(path)
    rng, set_num_threads = torch.get_rng_state(), torch.set_num_threads
    started = time.perf_counter()
    engine = VLLMRollout(str(path), tokenizer, "float32", seed=0, settings=Settings())
    seconds = time.perf_counter() - started
    STARTED[request.param] = {
        "rng kept": torch.equal(rng, torch.get_rng_state()),
        "set_num_threads kept": torch.set_num_threads is set_num_threads,
    }
    print(f"\nvLLM engine start-up ({request.param}): {seconds:.1f} s")
    yield engine, tokenizer, path
    engine.close()  # the next architecture's engine starts in a process without vLLM's groups


@pytest.fixture(scope="module")
def trained(setup):
    """The tiny model after a few optimizer steps on LESSONS: other weights, answers that end at EOS."""
    torch.manual_seed(0)
    return train(hf_model(setup[2]), setup[1])


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def left_padded(tokenizer, rows: list[list[int]]) -> RolloutRequest:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return RolloutRequest(ids, mask)


def prompts(tokenizer) -> RolloutRequest:
    """Prompts of different lengths: the lessons', an unseen one, and one with EOS inside."""
    rows = [tokenizer(p)["input_ids"] for p, _ in LESSONS]
    rows.append(tokenizer("Human: something never taught here, a longer question? Assistant:")["input_ids"])
    rows.append(tokenizer("Human: one")["input_ids"] + [tokenizer.eos_token_id] + tokenizer(" two:")["input_ids"])
    return left_padded(tokenizer, rows)


def train(model, tokenizer, steps: int = 200, lr: float = 3e-3):
    """AdamW steps of next-token loss on LESSONS (each answer followed by EOS) until they are memorized: real
    new weights. Dropout off (eval mode), so the memorized answers are greedy's."""
    model.eval()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rows = [tokenizer(p + a)["input_ids"] + [tokenizer.eos_token_id] for p, a in LESSONS]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    labels = ids.masked_fill(mask == 0, -100)
    for _ in range(steps):
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    return model


def hf_greedy(model, tokenizer, request: RolloutRequest, max_new_tokens: int) -> torch.Tensor:
    """HF generate's greedy [N, P + R]: pad after each row's EOS, as long as the longest row."""
    with torch.no_grad():
        return model.generate(
            input_ids=request.prompt_ids,
            attention_mask=request.prompt_attention_mask,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )


def greedy(max_new_tokens: int = 24, n: int = 1) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0, n_samples_per_prompt=n)


def loaded(engine, model) -> float:
    started = time.perf_counter()
    engine.load_weights(model)
    return time.perf_counter() - started


def responses(batch) -> list[list[int]]:
    """Each row's response tokens (its attention mask past response_start_idx)."""
    out = []
    for ids, mask, start in zip(batch.input_ids, batch.attention_mask, batch.response_start_idx, strict=True):
        out.append(ids[start:][mask[start:].bool()].tolist())
    return out


# --- greedy equals HF, before and after the weights change --------------------------------------------------


def test_greedy_equals_hf_generate_and_follows_new_weights(setup, trained):
    engine, tokenizer, path = setup
    request = prompts(tokenizer)
    base = hf_model(path)
    engine.load_weights(base)
    before = engine.generate(request, greedy())
    assert torch.equal(before.input_ids, hf_greedy(base, tokenizer, request, 24))

    seconds = loaded(engine, trained)
    print(f"\nload_weights: {seconds * 1000:.0f} ms")
    after = engine.generate(request, greedy())
    expected = hf_greedy(trained, tokenizer, request, 24)
    assert torch.equal(after.input_ids, expected)
    assert responses(after) != responses(before)  # the new weights answer otherwise: load_weights did something
    ends = [row[-1] == tokenizer.eos_token_id for row in responses(after)]
    lengths = {len(row) for row in responses(after)}
    assert ends[:2] == [True, True] and len(lengths) > 2  # rows ended at EOS at different lengths: padded after


def test_lora_adapter_is_merged_into_the_engines_weights(setup):
    from peft import LoraConfig, get_peft_model

    engine, tokenizer, path = setup
    request = prompts(tokenizer)
    target = ["q_proj", "v_proj", "fc1"] if "opt" in str(path) else ["q_proj", "v_proj", "up_proj"]
    torch.manual_seed(0)
    model = get_peft_model(
        hf_model(path), LoraConfig(r=4, lora_alpha=32, target_modules=target, init_lora_weights=False)
    )
    base_weight = model.get_base_model().get_input_embeddings().weight.clone()
    q = next(m for n, m in model.named_modules() if n.endswith("q_proj"))
    q_base = q.base_layer.weight.clone()
    engine.load_weights(model)
    # unmerged after the copy (merge then unmerge adds and subtracts the delta: equal up to rounding)
    assert not q.merged and torch.allclose(q.base_layer.weight, q_base, atol=1e-6)
    assert torch.equal(model.get_base_model().get_input_embeddings().weight, base_weight)
    batch = engine.generate(request, greedy())
    assert torch.equal(batch.input_ids, hf_greedy(model, tokenizer, request, 24))  # the adapter model's tokens
    engine.load_weights(hf_model(path))
    assert responses(engine.generate(request, greedy())) != responses(batch)  # the adapter mattered


def test_zero3_parameters_are_gathered_for_the_copy(setup, trained):
    import copy

    from kubealign.config.schema import SFTConfig
    from kubealign.training import distributed
    from kubealign.training import engine as engines

    engine, tokenizer, path = setup
    distributed.init()  # joins the process group the first engine made, as a trainer's would be joined
    cfg = SFTConfig(zero_stage=3, micro_batch_size=2, learning_rate=1e-3, lr_scheduler="constant")
    actor = engines.create(copy.deepcopy(trained), cfg, engines.ds_config(cfg, 1, cuda=False), total_steps=1)
    assert all(p.numel() == 0 for p in actor.module.parameters())  # partitioned: nothing to copy ungathered
    engine.load_weights(hf_model(path))  # the checkpoint's weights first
    engine.load_weights(actor.module)
    request = prompts(tokenizer)
    assert torch.equal(engine.generate(request, greedy()).input_ids, hf_greedy(trained, tokenizer, request, 24))
    assert all(p.numel() == 0 for p in actor.module.parameters())  # partitioned again after the copy


def test_two_ranks_each_with_an_engine_in_the_trainers_process_group():
    """torchrun with 2 ranks (tests/rl/vllm_ranks.py): ZeRO-3 gathered across ranks, each rank's own engine."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    torchrun = Path(sys.executable).parent / "torchrun"
    command = [str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "tests.rl.vllm_ranks"]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} of 2: partitioned True, greedy equal True" in done.stdout, done.stdout[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


# --- log-probs ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [0, 20])
def test_last_logprobs_are_the_trainers_at_the_response_actions(setup, trained, top_k):
    engine, tokenizer, path = setup
    model = trained  # weights other than the checkpoint's: the engine must compute with the loaded ones
    engine.load_weights(model)
    temperature = 0.7
    sampling = SamplingConfig(max_new_tokens=12, temperature=temperature, top_k=top_k, n_samples_per_prompt=2)
    batch = engine.generate(prompts(tokenizer), sampling)
    logprobs = engine.last_logprobs
    ids, mask = batch.input_ids, batch.attention_mask
    assert logprobs.shape == (ids.shape[0], ids.shape[1] - 1) and logprobs.dtype == torch.float32
    with torch.no_grad():
        logits = forward_logits(model, ids, mask)[:, :-1].float() / temperature
    if top_k:  # the distribution vLLM sampled from: the top k, renormalized
        kth = logits.topk(top_k, -1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    trainer = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    actions = mask[:, 1:].bool() & (torch.arange(ids.shape[1] - 1) >= batch.response_start_idx[:, None] - 1)
    gap = (logprobs - trainer)[actions].abs().max().item()
    print(f"\nlog-prob max |vLLM - trainer| (top_k {top_k}): {gap:.2e}")
    assert actions.sum() >= 20 and gap < LOGPROB_TOLERANCE
    assert torch.all(logprobs[~actions] == 0) and torch.all(logprobs[actions] <= 0) and logprobs.sum() < 0


# --- layout ---------------------------------------------------------------------------------------------------


def test_layout_is_the_hybrid_engines_with_samples_prompt_major(setup, trained):
    engine, tokenizer, path = setup
    engine.load_weights(trained)
    request = prompts(tokenizer)
    n, prompt_len = 2, request.prompt_ids.shape[1]
    batch = engine.generate(request, SamplingConfig(max_new_tokens=16, temperature=1.0, n_samples_per_prompt=n))
    assert batch.input_ids.shape[0] == n * request.prompt_ids.shape[0]
    assert torch.equal(batch.input_ids[:, :prompt_len], request.prompt_ids.repeat_interleave(n, 0))
    assert torch.equal(batch.attention_mask[:, :prompt_len], request.prompt_attention_mask.repeat_interleave(n, 0))
    assert torch.equal(batch.response_start_idx, torch.full((batch.batch_size,), prompt_len))
    rows = responses(batch)
    assert batch.seq_len == prompt_len + max(len(r) for r in rows)
    for ids, mask, row in zip(batch.input_ids, batch.attention_mask, rows, strict=True):
        tail = ids[prompt_len + len(row) :]
        assert torch.all(tail == tokenizer.pad_token_id) and torch.all(mask[prompt_len + len(row) :] == 0)
        assert torch.all(mask[prompt_len : prompt_len + len(row)] == 1)
        assert tokenizer.eos_token_id not in row[:-1]  # nothing after the first EOS
    assert any(rows[i] != rows[i + 1] for i in range(0, len(rows), n))  # a prompt's samples, not one twice


def test_stop_text_ends_the_response_with_it(setup, trained):
    engine, tokenizer, path = setup
    engine.load_weights(trained)
    request = prompts(tokenizer)
    free = responses(engine.generate(request, greedy(40)))
    cut = engine.generate(request, greedy(40), stop_text=STOP)
    rows = responses(cut)
    tool = 2  # LESSONS' tool-call prompt
    assert tokenizer.decode(free[tool]).count(STOP) == 1 and not tokenizer.decode(free[tool]).endswith(STOP)
    assert tokenizer.decode(rows[tool]).endswith(STOP)  # cut right after the stop text, which is kept
    # exactly the free answer's tokens up to the one that completes the stop text
    ends = next(k for k in range(1, len(free[tool]) + 1) if STOP in tokenizer.decode(free[tool][:k]))
    assert rows[tool] == free[tool][:ends]
    assert rows[:2] == free[:2]  # rows without the stop text end as before (at EOS)


# --- seeds ------------------------------------------------------------------------------------------------------


def test_sampling_repeats_under_the_same_seed(setup):
    engine, tokenizer, path = setup
    engine.load_weights(hf_model(path))
    request = prompts(tokenizer)
    sampling = SamplingConfig(max_new_tokens=10, temperature=1.0, top_p=0.9, n_samples_per_prompt=2)
    calls = engine.calls
    first = engine.generate(request, sampling)
    first_logprobs = engine.last_logprobs
    engine.calls = calls  # the same (seed, call) again: as a new engine with this seed would draw
    again = engine.generate(request, sampling)
    assert torch.equal(first.input_ids, again.input_ids) and torch.equal(first_logprobs, engine.last_logprobs)
    later = engine.generate(request, sampling)  # the next call: other draws
    assert responses(later) != responses(first)
    rows = responses(first)
    assert any(rows[i] != rows[i + 1] for i in range(0, len(rows), 2))  # a prompt's samples differ


# --- the trainer's process --------------------------------------------------------------------------------


def test_start_up_leaves_the_trainers_rng_and_threads_and_sleep_is_a_no_op_on_cpu(setup):
    engine, tokenizer, path = setup
    assert all(STARTED[next(a for a in STARTED if a in str(path))].values())
    engine.load_weights(hf_model(path))
    request = prompts(tokenizer)
    awake = engine.generate(request, greedy(8))
    engine.sleep()  # vLLM has no sleep mode on CPU: nothing happens
    assert not engine.sleep_mode and not engine.asleep
    engine.wake()
    assert torch.equal(engine.generate(request, greedy(8)).input_ids, awake.input_ids)


def test_vllm_names_drop_peft_wrappers():
    assert vllm_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == (
        "model.layers.0.self_attn.q_proj.weight"
    )
    assert vllm_name("base_model.model.lm_head.modules_to_save.default.weight") == "lm_head.weight"
    assert vllm_name("model.decoder.embed_tokens.weight") == "model.decoder.embed_tokens.weight"
