"""Path (d) of benchmarks/gpu_rollout.py: DeepSpeed's injected inference kernels, as DeepSpeed-Chat drives the
hybrid engine, in the legacy side environment (transformers 4.44, put in front of the path by gpu_rollout), one
process per variant and batch size (gpu_plan.legacy_cases), with its own greedy-token check after training."""

from __future__ import annotations

import os
import time
from typing import Any

from gpu_core import NEEDS_CUDA, SPECIAL, compare, free_port, greedy, hf_config, measure, random_prompts, version


def job_legacy(spec: dict[str, Any], progress: Any) -> dict[str, Any]:
    """DeepSpeedHybridEngine with kernel injection, as DeepSpeed-Chat drives it (engine.eval(), then
    module.generate), at one ZeRO stage with or without enable_cuda_graph and ONE batch size: DeepSpeed's
    inference workspace is sized at the engine's first forward and never grows, so each batch size gets a
    fresh process and engine (gpu_plan.legacy_cases). Speed, then (spec["correctness"]) 3 training steps
    and greedy tokens against HF eager generation from the same (gathered) weights."""
    import torch
    import transformers

    from kubealign.training import oplocks

    # A JIT build of an op killed at an earlier case's timeout leaves its lock, on which this process would
    # wait forever: cleared first (as every stage does through oplocks.guard), then watched while DeepSpeed
    # loads or builds its ops (below).
    progress.update(stale_locks_removed=[p.parent.name for p in oplocks.clear_stale()])
    progress.update(transformers=transformers.__version__, deepspeed=version("deepspeed"))
    # Imported before the CUDA check: a dry run on CPU proves the side environment loads DeepSpeed's
    # injection policies beside this transformers before any GPU time is spent on it.
    import deepspeed
    from deepspeed.module_inject.replace_policy import replace_policies

    progress.update(injection_policies=len(replace_policies))
    if not torch.cuda.is_available():
        return {"status": NEEDS_CUDA}
    from transformers import AutoModelForCausalLM

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    deepspeed.init_distributed(dist_backend="nccl", verbose=False)
    torch.manual_seed(0)
    config = hf_config(spec["shape"])
    model = AutoModelForCausalLM.from_config(config).to("cuda", torch.bfloat16)
    block = {
        "enabled": True,
        "max_out_tokens": 512,
        "inference_tp_size": 1,
        "release_inference_cache": False,
        "pin_parameters": True,
        "tp_gather_partition_size": 8,
        "enable_cuda_graph": spec["cuda_graph"],
    }
    ds = {
        "train_micro_batch_size_per_gpu": 4,
        "train_batch_size": 4,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": spec["zero"]},
        "hybrid_engine": block,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "steps_per_print": 10**9,
    }
    start = time.perf_counter()
    with oplocks.guard():  # loads (or, without the prebuilt ops, JIT-builds) fused_adam, transformer_inference
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    progress.update(
        init_s=time.perf_counter() - start,
        injected_layers=len(engine._inference_containers),
        cuda_graphs=getattr(engine, "_decode_graphs", None) is not None,
    )
    ids, mask = random_prompts(max(spec["batches"]), spec["prompt_len"], spec["shape"]["vocab_size"], "cuda")
    engine.eval()

    def run(batch: int) -> Any:
        def once(n: int) -> Any:
            return engine.module.generate(
                input_ids=ids[:batch],
                attention_mask=mask[:batch],
                do_sample=True,
                top_k=0,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=SPECIAL["pad"],
                eos_token_id=SPECIAL["eos"],
            )

        return once

    for b in spec["batches"]:
        progress.add(measure(run(b), b, spec["prompt_len"], spec["new_tokens"], spec["reps"]))
    if spec.get("correctness"):
        progress.update(correctness=legacy_correctness(engine, config, spec))
    return {}


def legacy_correctness(engine: Any, config: Any, spec: dict[str, Any]) -> dict[str, Any]:
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM

    c = spec["correctness"]
    engine.train()
    for step in range(c["updates"]):  # LM steps on random sequences: the weights move away from the initial ones
        seq, _ = random_prompts(4, c["prompt_len"] + c["new_tokens"], spec["shape"]["vocab_size"], "cuda", seed=step)
        engine.backward(engine(input_ids=seq, labels=seq).loss)
        engine.step()
    ids, mask = random_prompts(c["batch"], c["prompt_len"], spec["shape"]["vocab_size"], "cuda", seed=99)
    engine.eval()
    with torch.no_grad():
        out = engine.module.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=c["new_tokens"],
            pad_token_id=SPECIAL["pad"],
            eos_token_id=SPECIAL["eos"],
        )
    engine.train()
    reference = AutoModelForCausalLM.from_config(config).to("cuda", torch.bfloat16).eval()
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None), torch.no_grad():
        reference.load_state_dict({k: v.detach().clone() for k, v in engine.module.state_dict().items()})
    with torch.no_grad():
        expected, scores = greedy(reference, ids, mask, c["new_tokens"])
    return compare(out[:, ids.shape[1] :], expected, scores, tie=0.1)
