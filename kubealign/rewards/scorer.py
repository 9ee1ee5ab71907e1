"""One scorer for every stage that scores responses: the reward model, reward functions, or both.

score = rewards.model_weight * RM score + sum_i weight_i * f_i, where a function's None ("does not apply
to this row", as in TRL) adds 0 and is left out of that function's mean. The ppo stage's experience pass
and evaluate both call a Scorer with the token ids of prompt + response and the rows the prompts came
from; neither knows which kind of scorer it holds.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from kubealign.data.phases import Rows
from kubealign.models.value_head import score_and_value
from kubealign.usercode.definitions import FunctionSpec
from kubealign.usercode.runner import FunctionRunner


class Scores(NamedTuple):
    """What one Scorer call gives: each response's total score and each function's values (None: does not
    apply to that response)."""

    total: list[float]
    per_function: dict[str, list[float | None]]


def combine(
    model_scores: list[float] | None, model_weight: float, values: list[list[float | None]], weights: list[float]
) -> list[float]:
    """model_weight * model score + sum of weight * value over the functions (None adds 0), per response."""
    n = len(model_scores) if model_scores is not None else len(values[0])
    total = [model_weight * s for s in model_scores] if model_scores is not None else [0.0] * n
    for function_values, weight in zip(values, weights, strict=True):
        total = [t + (weight * v if v is not None else 0.0) for t, v in zip(total, function_values, strict=True)]
    return total


def scored_rows(has_model: bool, values: list[list[float | None]], n: int) -> list[bool]:
    """Per response: whether anything scored it, the reward model or at least one function (a value not None).
    A response nothing scored has score 0 by `combine`, which is no judgement: the group baselines leave it
    out (rl/advantages.group_stats) and the logged reward mean too, as the fn/NAME means leave out None."""
    if has_model:
        return [True] * n
    return [any(v[i] is not None for v in values) for i in range(n)]


def completions_of(tokenizer: Any, input_ids: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
    """The response text of each row: the tokens the response actions produced (action t made token t + 1),
    decoded without special tokens (the EOS)."""
    tokens = input_ids[:, 1:]
    return [
        tokenizer.decode(row[mask.bool()].tolist(), skip_special_tokens=True)
        for row, mask in zip(tokens, response_mask, strict=True)
    ]


class Scorer:
    """Callable: (input_ids [N, T], attention_mask [N, T], response_mask [N, T-1], rows) -> scores [N] float.

    model: the reward model (module or frozen engine) or None; runner: the functions' FunctionRunner or None;
    tokenizer: what decodes the completions for the functions (None without functions)."""

    def __init__(self, model: Any, model_weight: float, runner: FunctionRunner | None, tokenizer: Any):
        self.model, self.model_weight, self.runner, self.tokenizer = model, model_weight, runner, tokenizer
        # the runner's worker also runs the tools and the environment (kind tool / environment): not scores
        self.specs: list[FunctionSpec] = [s for s in runner.specs if s.kind == "reward"] if runner is not None else []

    def eval(self) -> Scorer:
        if self.model is not None:
            self.model.eval()
        return self

    @torch.no_grad()
    def __call__(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor, rows: Rows | None
    ) -> torch.Tensor:
        return torch.tensor(self.score(input_ids, attention_mask, response_mask, rows).total, device=input_ids.device)

    @torch.no_grad()
    def scored(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor, rows: Rows | None
    ) -> tuple[torch.Tensor, torch.Tensor, Scores]:
        """(scores [N] float, scored [N] bool: scored_rows, the Scores they came from) of the rows."""
        scores = self.score(input_ids, attention_mask, response_mask, rows)
        mask = scored_rows(self.model is not None, list(scores.per_function.values()), len(scores.total))
        device = input_ids.device
        total = torch.tensor(scores.total, device=device)
        return total, torch.tensor(mask, dtype=torch.bool, device=device), scores

    @torch.no_grad()
    def score(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor, rows: Rows | None
    ) -> Scores:
        """The rows' total scores and each function's values."""
        model_scores = None
        if self.model is not None:
            model_scores = score_and_value(self.model, input_ids, attention_mask)[1].float().tolist()
        values: dict[str, list[float | None]] = {}
        if self.specs:
            assert self.runner is not None and rows is not None, "reward functions need the rows of the batch"
            if len(rows.prompts) != input_ids.shape[0]:  # scoring shifted rows would reward the wrong prompts
                raise ValueError(
                    f"reward scoring: {len(rows.prompts)} data rows for {input_ids.shape[0]} "
                    "completions; expected one row per completion"
                )
            completions = completions_of(self.tokenizer, input_ids, response_mask)
            for spec in self.specs:
                values[spec.name] = self.runner.call(spec, rows.prompts, completions, rows.columns, rows.origins)
        weights = [s.weight for s in self.specs]
        return Scores(combine(model_scores, self.model_weight, list(values.values()), weights), values)
