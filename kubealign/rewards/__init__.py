"""Rewards: what scores a response — the reward model, reward functions as code (verifiable rewards), or both.

- scorer: one call (token ids + the rows' prompts and columns -> one score per response) for the reward model
  and the functions alike, used by the RL stages' experience pass and by evaluate;
- totals: each reward function's mean over the rows it applies to.

The functions themselves are user code and live with the other user code (tools, environments) in
kubealign.usercode: where they are defined, the worker they run in, its sandbox.
"""
