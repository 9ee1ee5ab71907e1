"""GRPO at real lengths: kubealign's ppo stage (ppo.algorithm grpo) against TRL's GRPOTrainer.

Same model (build/models/opt-125m-hh, random weights), same prompts (the hh-real-lengths preset's phase-3
split, cut to its 256 tokens; TRL gets them decoded back to text), same reward (benchmarks/grpo_reward.py's
function on both sides), same shape: per iteration 4 prompts x 2 responses (GRPO's group), at most 256 new
tokens sampled at temperature 1, one optimizer step on the 8 responses, KL coefficient 0.1 (so both run the
reference model), fp32, learning rate and clipping of the preset. kubealign runs as a user runs it (`kubealign
ppo`, one process per round, its per-iteration time split read from result.json; tracking off); TRL in this
process, timed from its start of training to the end of each step. Rounds interleave the two.

Reported: responses per second over the iterations, and for kubealign the generation / experience /
training split (TRL's trainer does not split its step). With random weights the answers mostly run to the
256-token cap on both sides, so generation (the same transformers `generate` on CPU) is most of the time.

  .venv-trl/bin/python benchmarks/trl_compare.py --stages grpo     # this harness, through trl_compare
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import real_lengths as rl

PROMPTS, GROUP = 4, 2  # prompts per iteration x responses per prompt
KL = 0.1  # the KL coefficient of both sides (kubealign's ppo.kl_coef, TRL's beta): both run the reference
REWARD = Path(__file__).resolve().parent / "grpo_reward.py"


def settings(config: Any) -> dict[str, Any]:
    return {
        "prompts": PROMPTS,
        "group": GROUP,
        "max_new_tokens": config.ppo.max_new_tokens,
        "max_prompt_len": config.ppo.max_prompt_len,
        "kl_coef": KL,
        "learning_rate": config.ppo.actor_learning_rate,
    }


def split(work: Path) -> Path:
    """The preset's data split (phase 3: the prompts), with 2 eval prompts (the stage samples them before and
    after training: not timed, kept small)."""
    out = work / "split"
    if not (out / "result.json").exists():
        kubealign("data-split", "--config", str(rl.PRESET), "--set", "data.eval_fraction=0.002", "--output", str(out))
    return out


def kubealign(*args: str) -> None:
    exe = str(Path(sys.executable).parent / "kubealign")
    from kubealign.ranks import RENDEZVOUS_ENV

    # a job of its own: not the rendezvous of this process's one-rank group (trl_compare's)
    env = {**{k: v for k, v in os.environ.items() if k not in RENDEZVOUS_ENV}, "TQDM_DISABLE": "1"}
    done = subprocess.run([exe, *args], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"kubealign {args[0]} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")


def run_kubealign(work: Path, model_dir: Path, seed: int, iterations: int) -> dict[str, Any]:
    out = work / f"kubealign-{seed}"
    sets = {
        "ppo.algorithm": "grpo",
        "ppo.samples_per_prompt": GROUP,
        "ppo.generation_batch_size": PROMPTS,
        "ppo.micro_batch_size": PROMPTS * GROUP,
        "ppo.num_iterations": iterations,
        "ppo.seed": seed,
        "ppo.kl_coef": KL,
        "ppo.sample_every_iterations": 0,
        "rewards.model_weight": 0,
        "rewards.functions": json.dumps([{"path": f"{REWARD}:brevity"}]),
        "tracking.enabled": "false",
    }
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    kubealign(
        "ppo",
        "--config",
        str(rl.PRESET),
        *args,
        "--prompts",
        str(split(work)),
        "--actor",
        str(model_dir),
        "--output",
        str(out),
    )
    history = json.loads((out / "result.json").read_text())["history"]
    parts = {k: sum(h[f"{k}_time_s"] for h in history) for k in ("generation", "experience", "training")}
    return {
        "seconds": sum(parts.values()),
        "responses": PROMPTS * GROUP * len(history),
        "split_s": parts,
        "response_length": [round(h["response_length"], 1) for h in history],
        "reward": [round(h["reward_mean"], 4) for h in history],
    }


def trl_prompts(work: Path, tokenizer: Any, max_prompt_len: int) -> list[str]:
    """Phase 3's training prompts as kubealign encodes and cuts them, decoded back to text for TRL."""
    from kubealign.data import phases
    from kubealign.stages.ppo import encode_prompts

    dataset = phases.load(split(work), "phase3_prompts")
    return [
        tokenizer.decode(ids, skip_special_tokens=True)
        for ids in encode_prompts(dataset["train"], tokenizer, max_prompt_len)
    ]


def run_trl(prompts: list[str], model_dir: Path, seed: int, iterations: int, config: Any) -> dict[str, Any]:
    import trl
    from datasets import Dataset
    from grpo_reward import brevity  # beside this file, on the path as real_lengths is
    from trl_common import Counter, alone, trl_callback

    from kubealign.models import loading

    tokenizer = loading.load_tokenizer(str(model_dir))
    model = rl.no_dropout(loading.load_causal_lm(str(model_dir)))
    with tempfile.TemporaryDirectory() as out, alone():
        args = trl.GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=PROMPTS * GROUP,
            num_generations=GROUP,
            max_completion_length=config.ppo.max_new_tokens,
            temperature=1.0,
            beta=KL,
            learning_rate=config.ppo.actor_learning_rate,
            max_grad_norm=config.ppo.gradient_clipping,
            max_steps=iterations,
            seed=seed,
            data_seed=seed,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            use_cpu=True,
            gradient_checkpointing=False,  # as trl_compare's "trl" side
        )
        trainer = trl.GRPOTrainer(
            model=model,
            reward_funcs=[brevity],
            args=args,
            processing_class=tokenizer,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
        )
        counter = Counter(trainer.model)
        trainer.add_callback(trl_callback(counter))
        trainer.train()
        logs = [h for h in trainer.state.log_history if "reward" in h]
    return {
        "seconds": counter.marks[-1][0] - counter.marks[0][0],
        "responses": PROMPTS * GROUP * iterations,
        "response_length": [round(h.get("completions/mean_length", 0), 1) for h in logs],
        "reward": [round(h["reward"], 4) for h in logs],
    }


def measure(model_dir: Path, config: Any, tokenizer: Any, rounds: int, iterations: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prompts = trl_prompts(work, tokenizer, config.ppo.max_prompt_len)
        runs: dict[str, list[dict[str, Any]]] = {"kubealign": [], "trl": []}
        for r in range(rounds):
            for side in ("kubealign", "trl") if r % 2 == 0 else ("trl", "kubealign"):
                seed = 100 + r
                found = (
                    run_kubealign(work, model_dir, seed, iterations)
                    if side == "kubealign"
                    else run_trl(prompts, model_dir, seed, iterations, config)
                )
                runs[side].append(found)
                print(f"  grpo round {r + 1} {side}: {found['seconds']:.1f} s", file=sys.stderr)
    out: dict[str, Any] = {
        "settings": settings(config),
        "iterations_per_round": iterations,
        "rounds": rounds,
        "sides": {},
    }
    for side, found in runs.items():
        out["sides"][side] = {
            "responses_per_s": sum(x["responses"] for x in found) / sum(x["seconds"] for x in found),
            "round_s": [round(x["seconds"], 2) for x in found],
            "response_length": [x["response_length"] for x in found],
            "reward": [x["reward"] for x in found],
        }
    parts = [x["split_s"] for x in runs["kubealign"]]
    out["sides"]["kubealign"]["split_s"] = {k: round(sum(p[k] for p in parts), 2) for k in parts[0]}
    out["best_trl"] = "trl"
    out["speedup"] = out["sides"]["kubealign"]["responses_per_s"] / out["sides"]["trl"]["responses_per_s"]
    return out
