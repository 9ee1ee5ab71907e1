"""Multi-turn rollouts: the model calls tools (or acts in an environment) between its turns.

Every trajectory starts from its prompt (the batch's prompts, each repeated group_size times, contiguous as
the single-turn rollout has them). A turn generates for every trajectory still going, in one batch (their
contexts left-padded), until it closes a tool call, samples EOS or spends its token budget; all rows then
wait for the turn's slowest row only, and every call of the turn runs in one request to the sandboxed worker.
With tools, a turn that calls a tool gets the tool's result appended as an observation (<tool_response>,
kubealign.rl.tool_calls), a malformed call an error observation; a turn without a call ends the trajectory.
With an environment, each turn is its action: step(action) gives the observation, a reward and done.

The result is one right-padded batch after the left-padded prompts, as the single-turn rollout gives, with
the masks the experience pass reads: `response_mask` marks the actions that produced the model's own tokens
(observation tokens are not the model's: no loss, no KL, no entropy on them), `trajectory_mask` every token
after the prompt (what reward functions read: the whole trajectory, calls and results). With no call made,
the batch is the single-turn rollout's (tests/rl/test_multiturn.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from kubealign.config.schema import PPOConfig
from kubealign.config.tools import ToolsConfig
from kubealign.rl import tool_calls
from kubealign.rl.experience import Experience
from kubealign.training import distributed

OBSERVATION, MODEL = 0, 1  # what produced a trajectory token


class MultiTurnBatch(NamedTuple):
    input_ids: torch.Tensor  # [N, T] left-padded prompt (Tp columns), then the right-padded trajectory
    attention_mask: torch.Tensor  # [N, T]
    response_mask: torch.Tensor  # [N, T-1] actions that produced the model's tokens
    trajectory_mask: torch.Tensor  # [N, T-1] actions that produced any token after the prompt
    response_start_idx: torch.Tensor  # [N] = Tp: where the trajectory starts
    turns: torch.Tensor  # [N] model turns taken
    calls: torch.Tensor  # [N] tool calls made (malformed ones included)
    malformed: torch.Tensor  # [N] malformed calls
    env_rewards: list[float | None] | None  # [N] the environment's summed rewards (None: it gave none); None: tools


@dataclass
class Trajectory:
    prompt: list[int]  # the real prompt tokens
    tokens: list[int] = field(default_factory=list)  # everything after the prompt
    sources: list[int] = field(default_factory=list)  # MODEL or OBSERVATION per token
    turns: int = 0
    calls: int = 0
    malformed: int = 0
    reward: float | None = None
    done: bool = False

    def add(self, tokens: list[int], source: int) -> None:
        self.tokens += tokens
        self.sources += [source] * len(tokens)


class ToolSession:
    """What a multi-turn rollout needs besides the actor: the tools section, the worker that runs the user's
    tools or environment (rewards.functions.FunctionRunner), the tokenizer and the tools' schemas block."""

    def __init__(self, tools: ToolsConfig, runner: Any, tokenizer: Any):
        self.tools, self.runner, self.tokenizer = tools, runner, tokenizer
        self.preamble: list[int] = []
        if tools.functions and tools.show_schemas:
            block = tool_calls.tools_block(runner.schemas())
            self.preamble = tokenizer(block, add_special_tokens=False).input_ids

    def encode(self, text: str, limit: int) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids[:limit]


def end_of_turn(tokens: list[int], tokenizer: Any, eos_id: int) -> int:
    """How many of a turn's sampled tokens are the turn's: through the first EOS, or through the token that
    completes CALL_CLOSE, whichever comes first; all of them if neither."""
    eos = tokens.index(eos_id) + 1 if eos_id in tokens else len(tokens)
    text = tokenizer.decode(tokens[:eos], skip_special_tokens=False)
    at = text.find(tool_calls.CALL_CLOSE)
    if at < 0:
        return eos
    goal = at + len(tool_calls.CALL_CLOSE)
    low, high = 1, eos  # the shortest prefix whose text reaches past the close tag
    while low < high:
        mid = (low + high) // 2
        if len(tokenizer.decode(tokens[:mid], skip_special_tokens=False)) >= goal:
            high = mid
        else:
            low = mid + 1
    return low


class EndedAtText:
    """A stopping criterion: a row is finished once the text it generated after `start` contains `text`."""

    def __init__(self, tokenizer: Any, text: str, start: int):
        self.tokenizer, self.text, self.start = tokenizer, text, start
        self.window = len(text) + 1  # tokens enough to spell it (a token holds at least one character)

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        begin = max(self.start, input_ids.shape[1] - self.window)
        tails = self.tokenizer.batch_decode(input_ids[:, begin:], skip_special_tokens=False)
        return torch.tensor([self.text in t for t in tails], dtype=torch.bool, device=input_ids.device)


def left_padded(contexts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, contexts))
    ids = torch.full((len(contexts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(contexts), width, dtype=torch.long)
    for i, c in enumerate(contexts):
        ids[i, width - len(c) :] = torch.tensor(c, dtype=torch.long)
        mask[i, width - len(c) :] = 1
    return ids, mask


def rollout(
    models: Any,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    cfg: PPOConfig,
    session: ToolSession,
    rows: Any = None,
    sample: Any = None,
) -> MultiTurnBatch:
    """Trajectories of up to tools.max_turns turns for the left-padded prompts ([B, Tp], each repeated
    cfg.group_size times; the batch's prompt columns are the longest prompt's, with the schemas block when
    tools.show_schemas). rows: the prompts' data rows (rewards.scorer.Rows, one per prompt), what an
    environment's reset reads. sample: what generates a turn (default rl.rollout.generate; a stand-in in tests).
    With the actor at ZeRO-3 on several ranks (models.synced_gpus) every rank takes as many turns as the rank
    that needs the most (_any_rank_going, _idle_turn): each turn's generate is a collective."""
    tools, tokenizer = session.tools, session.tokenizer
    k = cfg.group_size
    eos = tokenizer.eos_token_id
    trajectories = [  # the tools' schemas block (if shown) is part of every prompt, in training as in sampling
        Trajectory(session.preamble + ids[mask.bool()].tolist())
        for ids, mask in zip(prompt_ids.repeat_interleave(k, 0), prompt_mask.repeat_interleave(k, 0), strict=True)
    ]
    environment = tools.environment is not None
    if environment:
        _reset(session, trajectories, rows, k)
    for _ in range(tools.max_turns):
        going = [t for t in trajectories if not t.done]
        if not _any_rank_going(models, going):
            break
        if not going:  # this rank is done, another is not: its generate's collectives need this rank too
            _idle_turn(models, cfg, trajectories[0], prompt_ids.device, sample)
            continue
        _turn(models, cfg, session, going, eos, prompt_ids.device, sample)
        if environment:
            _step(session, trajectories, going, rows, k)
        else:
            _answer_calls(session, going)
    return assemble(trajectories, max(len(t.prompt) for t in trajectories), tokenizer.pad_token_id, environment)


def _any_rank_going(models: Any, going: list[Trajectory]) -> bool:
    """Whether a trajectory is still going here or, when the ranks generate in lockstep (models.synced_gpus: the
    actor at ZeRO-3 on several ranks, each decode forward an all-gather of its weights), on any rank. Every rank
    then takes the same number of turns, each one generate call, and no rank waits in a gather the others left."""
    here = float(bool(going))
    if not getattr(models, "synced_gpus", False):
        return bool(here)
    return distributed.all_reduce_max([here])[0] > 0


def _idle_turn(models: Any, cfg: PPOConfig, first: Trajectory, device: torch.device, sample: Any = None) -> None:
    """A turn for a rank whose trajectories are all done while another rank's are not: one token for a row of its
    first prompt, thrown away. generate's synced_gpus keeps this rank running forwards (without sampling) until
    every rank's turn has ended, so the gathers inside them line up (DeepSpeed #8321)."""
    from kubealign.rl.rollout import generate

    ids, mask = left_padded([first.prompt], models.tokenizer.pad_token_id)
    (sample or generate)(models, ids.to(device), mask.to(device), cfg, max_new_tokens=1, samples=1)


def _turn(
    models: Any,
    cfg: PPOConfig,
    session: ToolSession,
    going: list[Trajectory],
    eos: int,
    device: torch.device,
    sample: Any = None,
) -> None:
    """One generation for the trajectories still going; each gets its turn's tokens (cut by end_of_turn and by
    its budget) and is done when the budget is spent. eos: where a turn ends (end_of_turn)."""
    from kubealign.rl.rollout import generate

    generate = sample or generate

    tools, tokenizer = session.tools, session.tokenizer
    left = [tools.max_total_tokens - len(t.tokens) for t in going]
    contexts = [t.prompt + t.tokens for t in going]
    ids, mask = left_padded(contexts, tokenizer.pad_token_id)
    width = ids.shape[1]
    stop = EndedAtText(tokenizer, tool_calls.CALL_CLOSE, width)
    most = min(cfg.max_new_tokens, max(left))
    out = generate(models, ids.to(device), mask.to(device), cfg, max_new_tokens=most, samples=1, stop=stop)
    for t, row, budget in zip(going, out.input_ids[:, width:].tolist(), left, strict=True):
        sampled = row[:budget]
        kept = sampled[: end_of_turn(sampled, tokenizer, eos)]
        t.add(kept, MODEL)
        t.turns += 1
        # with tools a turn without a call ends the trajectory (_answer_calls); an environment says when it is done
        t.done = len(t.tokens) >= tools.max_total_tokens


def _answer_calls(session: ToolSession, going: list[Trajectory]) -> None:
    """Parse each turn's call; run the well-formed ones in one request; append every observation (cut to the
    budget); a turn without a call, or one that ended with EOS (an unclosed call, counted malformed), ends its
    trajectory."""
    tools, tokenizer = session.tools, session.tokenizer
    waiting, calls = [], []
    for t in going:
        if t.done:
            continue
        turn = tokenizer.decode(t.tokens[_last_turn_start(t) :], skip_special_tokens=False)
        call = tool_calls.parse(turn)
        if call is None:
            t.done = True
            continue
        t.calls += 1
        malformed = isinstance(call, tool_calls.Malformed)
        t.malformed += malformed
        if t.tokens[-1] == tokenizer.eos_token_id:  # it ended its answer inside an unclosed call: nothing to answer
            t.done = True
        elif malformed:
            _observe(session, t, tool_calls.response(call.reason, error=True))
        else:
            waiting.append(t)
            calls.append({"name": call.name, "arguments": call.arguments})
    chars = tool_calls.result_chars(tools.max_result_tokens)  # cut in the worker, and here again before tokenizing
    answers = session.runner.tool_calls(calls, chars) if calls else []  # one request for the whole turn
    for t, (text, error) in zip(waiting, answers, strict=True):
        inner = tokenizer.decode(session.encode(text[:chars], tools.max_result_tokens))
        _observe(session, t, tool_calls.response(inner, error))


def _observe(session: ToolSession, t: Trajectory, text: str) -> None:
    room = session.tools.max_total_tokens - len(t.tokens)
    t.add(session.encode(text[: tool_calls.result_chars(room) + len(tool_calls.RESULT_OPEN)], room), OBSERVATION)
    t.done = t.done or len(t.tokens) >= session.tools.max_total_tokens


def _last_turn_start(t: Trajectory) -> int:
    """Index of the first token of the trajectory's last model turn (after its last observation)."""
    i = len(t.sources)
    while i > 0 and t.sources[i - 1] == MODEL:
        i -= 1
    return i


def _reset(session: ToolSession, trajectories: list[Trajectory], rows: Any, k: int) -> None:
    payload = {"slots": list(range(len(trajectories))), "rows": [_row(rows, i // k) for i in range(len(trajectories))]}
    payload["max_chars"] = tool_calls.result_chars(session.tools.max_total_tokens)
    origins = [rows.origins[i // k] for i in range(len(trajectories))] if rows is not None else []
    reply = session.runner.environment("reset", payload, origins)
    for t, observation in zip(trajectories, reply["observations"], strict=True):
        if observation:
            _observe(session, t, tool_calls.escape(observation))


def _step(session: ToolSession, trajectories: list[Trajectory], going: list[Trajectory], rows: Any, k: int) -> None:
    tokenizer = session.tokenizer
    slots = [trajectories.index(t) for t in going]
    actions = [tokenizer.decode(t.tokens[_last_turn_start(t) :], skip_special_tokens=True) for t in going]
    origins = [rows.origins[s // k] for s in slots] if rows is not None else []
    chars = tool_calls.result_chars(session.tools.max_total_tokens)
    reply = session.runner.environment("step", {"slots": slots, "actions": actions, "max_chars": chars}, origins)
    for t, step in zip(going, reply["steps"], strict=True):
        if step["reward"] is not None:
            t.reward = (t.reward or 0.0) + step["reward"]
        if step["observation"] and not step["done"] and not t.done:
            _observe(session, t, tool_calls.escape(step["observation"]))
        t.done = t.done or step["done"]


def _row(rows: Any, i: int) -> dict[str, Any]:
    if rows is None:
        return {}
    return {"prompt": rows.prompts[i], **{name: values[i] for name, values in rows.columns.items()}}


def assemble(trajectories: list[Trajectory], prompt_width: int, pad_id: int, environment: bool) -> MultiTurnBatch:
    """The trajectories as one batch: each prompt left-padded to prompt_width, its trajectory after it,
    right-padded to the longest; the masks of MultiTurnBatch."""
    n = len(trajectories)
    longest = max((len(t.tokens) for t in trajectories), default=0)
    width = prompt_width + max(longest, 1)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros(n, width, dtype=torch.long)
    model = torch.zeros(n, width, dtype=torch.long)
    for i, t in enumerate(trajectories):
        p = len(t.prompt)
        ids[i, prompt_width - p : prompt_width] = torch.tensor(t.prompt, dtype=torch.long)
        attention[i, prompt_width - p : prompt_width + len(t.tokens)] = 1
        if t.tokens:
            ids[i, prompt_width : prompt_width + len(t.tokens)] = torch.tensor(t.tokens, dtype=torch.long)
            model[i, prompt_width : prompt_width + len(t.tokens)] = torch.tensor(t.sources, dtype=torch.long)
    after = torch.zeros_like(attention)
    after[:, prompt_width:] = attention[:, prompt_width:]
    return MultiTurnBatch(
        ids,
        attention,
        model[:, 1:],
        after[:, 1:],
        torch.full((n,), prompt_width, dtype=torch.long),
        torch.tensor([t.turns for t in trajectories]),
        torch.tensor([t.calls for t in trajectories]),
        torch.tensor([t.malformed for t in trajectories]),
        [t.reward for t in trajectories] if environment else None,
    )


def with_environment_rewards(exp: Experience, rewards: list[float | None] | None) -> Experience:
    """The experience with an environment's summed rewards added to the scores (None: it gave none, adds 0);
    a trajectory the environment rewarded counts as scored."""
    if rewards is None:
        return exp
    given = torch.tensor([r is not None for r in rewards], device=exp.scores.device)
    extra = torch.tensor([r or 0.0 for r in rewards], dtype=exp.scores.dtype, device=exp.scores.device)
    scored = None if exp.scored is None else exp.scored | given  # None: every row was scored already
    return exp._replace(scores=exp.scores + extra, scored=scored)


def turn_metrics(batch: MultiTurnBatch) -> dict[str, float]:
    """Multi-turn figures pooled over every rank: turns and tool calls per trajectory, the share of calls
    that were malformed, and observation tokens per trajectory."""
    observed = (batch.trajectory_mask.bool() & ~batch.response_mask.bool()).sum()
    turns, calls, bad, seen, n = distributed.all_reduce_sum(
        [
            float(batch.turns.sum()),
            float(batch.calls.sum()),
            float(batch.malformed.sum()),
            float(observed),
            float(batch.turns.numel()),
        ]
    )
    return {
        "turns_mean": turns / n,
        "tool_calls_mean": calls / n,
        "malformed_call_rate": bad / calls if calls else 0.0,
        "observation_tokens_mean": seen / n,
    }
