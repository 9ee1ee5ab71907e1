"""Rewards: what scores a response — the reward model, reward functions as code (verifiable rewards), or both.

- sources: resolve `rewards.functions` to FunctionSpecs (the function file's source text travels with them,
  so a compiled pipeline carries it and hashes it into the cache keys of the tasks that use it);
- functions: run them in a worker process with a per-call timeout, and check what they return;
- scorer: one call (token ids + the rows' prompts and columns -> one score per response) for the reward model
  and the functions alike, used by the ppo stage's experience pass and by evaluate.
"""
