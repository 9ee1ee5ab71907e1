"""The reward function of benchmarks/trl_grpo.py: the same Python function scores GRPO's responses on both
sides (kubealign's rewards.functions and TRL's reward_funcs take f(prompts, completions, **columns)). Cheap and
stdlib-only, so it costs neither side anything: the benchmark is about the passes, not the scorer."""


def brevity(prompts, completions, **columns):
    """Shorter answers score higher: -1 per 100 characters."""
    return [-len(c) / 100 for c in completions]
