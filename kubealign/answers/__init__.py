"""A model's answers and their scores: what evaluate, the online judge and the feedback push share.

The package, in the order an evaluation uses it:
- sampling: held-out prompts in, each model's seeded answers out as sample rows (`sample`; `sampled` for both
  models, in turns when there are tools; `batched`, the rows in scoring batches). The feedback push samples here.
- turns: answers sampled in turns with tools, as the policy trained (rl.multiturn), and their tool-use figures.
- scoring: the scorer's score of each row (`score`, also the online judge's), the KL of the candidate to the
  baseline, the held-out reward model's scores, the held-out log-likelihood and the other guard figures.
- grades: the synthetic task's grammar grade of the decoded answers (well formed, on topic, preferred).
- llm_judge: the LLM judge, asked about both orders of each pair; its verdict rules and figures (`llm_judged`,
  also the online judge's).
- suites: both models on lm-eval-harness suites, and lm-eval's results read into the suite guard's figures.

It sits above the rules (rl, selection, promotion's guards read what it measures) and below its users (feedback,
stages): it imports neither.
"""
