"""User code: the reward functions, tools and environments a user writes, and where they run.

- definitions: resolve `rewards.functions` and the `tools` section into FunctionSpecs (the source text travels
  with them, so a compiled pipeline carries it and hashes it into the cache keys of the tasks that use it);
- runner: FunctionRunner, which starts the worker, calls it with a per-call deadline and checks each answer;
- worker: the process the code runs in (`python -m kubealign.usercode.worker`), nothing of the trainer's in it;
- sandbox: what the worker does to itself before it loads user code, and what the trainer does meanwhile.

Nothing here scores: kubealign.rewards turns what reward functions return into rewards.
"""
