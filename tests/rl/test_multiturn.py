"""Multi-turn rollouts with tools (issue 58): the masks of hand-made trajectories token by token (rows with
different numbers of turns and padding), the KL and GAE over them, the turn loop with a scripted sampler and
a stand-in tool runner (a call answered, a malformed call answered with an error, the budget, no call =
the single-turn rollout), the call format, and the tools config."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kubealign.config import load_config
from kubealign.config.ppo import PPOConfig
from kubealign.config.tools import ToolsConfig
from kubealign.rl import multiturn as mt
from kubealign.rl import tool_calls as tc
from kubealign.rl.advantages import gae, kl_penalized_rewards
from kubealign.rl.experience import response_masks
from tests.support.chars import EOS, PAD, Chars

pytestmark = pytest.mark.unit
CHARS = Chars()


def trajectory(prompt: list[int], *pieces: tuple[list[int], int]) -> mt.Trajectory:
    t = mt.Trajectory(prompt)
    for tokens, source in pieces:
        t.add(tokens, source)
    return t


M, OBS = mt.MODEL, mt.OBSERVATION
HAND_MADE = [  # 2 turns ending in EOS; 1 turn; 3 turns cut by the budget (no EOS)
    trajectory([5, 6, 7], ([10, 11], M), ([20, 21, 22], OBS), ([12, EOS], M)),
    trajectory([5], ([13, EOS], M)),
    trajectory([5, 6], ([14], M), ([23], OBS), ([15], M), ([24, 25], OBS), ([16], M)),
]


def test_the_masks_of_hand_made_trajectories_token_by_token():
    batch = mt.assemble(HAND_MADE, 3, PAD, environment=False)
    assert batch.input_ids.tolist() == [
        [5, 6, 7, 10, 11, 20, 21, 22, 12, EOS],
        [PAD, PAD, 5, 13, EOS, PAD, PAD, PAD, PAD, PAD],
        [PAD, 5, 6, 14, 23, 15, 24, 25, 16, PAD],
    ]
    assert batch.attention_mask.tolist() == [[1] * 10, [0, 0, 1, 1, 1, 0, 0, 0, 0, 0], [0] + [1] * 8 + [0]]
    # action t produced token t + 1: only the model's own tokens are response actions
    assert batch.response_mask.tolist() == [
        [0, 0, 1, 1, 0, 0, 0, 1, 1],
        [0, 0, 1, 1, 0, 0, 0, 0, 0],
        [0, 0, 1, 0, 1, 0, 0, 1, 0],
    ]
    assert batch.trajectory_mask.tolist() == [
        [0, 0, 1, 1, 1, 1, 1, 1, 1],
        [0, 0, 1, 1, 0, 0, 0, 0, 0],
        [0, 0, 1, 1, 1, 1, 1, 1, 0],
    ]
    assert batch.response_start_idx.tolist() == [3, 3, 3]


def test_the_kl_and_the_score_count_the_models_tokens_only():
    batch = mt.assemble(HAND_MADE, 3, PAD, environment=False)
    logprobs = torch.full(batch.response_mask.shape, -1.0)  # log pi - log ref = 2 on every action
    ref = torch.full(batch.response_mask.shape, -3.0)
    out = kl_penalized_rewards(logprobs, ref, torch.tensor([1.0, 2.0, 3.0]), batch.response_mask, 0.5, 10.0)
    assert out.kl.sum(-1).tolist() == [8.0, 4.0, 6.0]  # 4, 2 and 3 model tokens
    # -beta * 2 on each model action, the score added at the last model action (row 2: token 16, action 7)
    assert out.rewards[2].tolist() == [0, 0, -1, 0, -1, 0, 0, 2.0, 0]
    assert out.rewards[0, 4:7].tolist() == [0, 0, 0]  # observations: no reward, no penalty


def test_gae_steps_over_the_observations_as_if_they_were_not_there():
    batch = mt.assemble(HAND_MADE, 3, PAD, environment=False)
    mask = batch.response_mask
    g = torch.Generator().manual_seed(0)
    values, rewards = torch.randn(mask.shape, generator=g), torch.randn(mask.shape, generator=g)
    full = gae(values, rewards, mask, 0.9, 0.8)
    for row in range(mask.shape[0]):
        kept = mask[row].bool()
        alone = gae(values[row][kept][None], rewards[row][kept][None], torch.ones(1, int(kept.sum())), 0.9, 0.8)
        assert torch.allclose(full.advantages[row][kept], alone.advantages[0], atol=1e-6)
        assert torch.allclose(full.returns[row][kept], alone.returns[0], atol=1e-6)
        assert not full.advantages[row][~kept].any()


# --- the turn loop ---------------------------------------------------------------------------------------------


class StandInTools:
    """FunctionRunner's tool side: `add` sums its arguments; every request is kept."""

    def __init__(self) -> None:
        self.requests: list[list[dict]] = []

    def tool_calls(self, calls, max_chars=None):
        self.requests.append(calls)
        out = []
        for call in calls:
            if call["name"] == "add":
                out.append((str(call["arguments"]["a"] + call["arguments"]["b"]), False))
            else:
                out.append((f"unknown tool {call['name']!r}", True))
        return out

    def schemas(self):
        return [{"name": "add"}]


def scripted(turns: list[list[str]], seen: list[list[str]]):
    """A sampler that answers the i-th turn's rows with turns[i] (§ is EOS; text past the turn's end is
    sampled on, as rows that are finished keep sampling in a batch), padded to max_new_tokens."""

    calls = iter(turns)

    def sample(models, ids, mask, cfg, max_new_tokens, samples, stop):
        texts = next(calls)
        assert samples == 1 and len(texts) == ids.shape[0] and stop.start == ids.shape[1]
        seen.append([CHARS.decode(row[m.bool()]) for row, m in zip(ids, mask, strict=True)])
        new = torch.full((ids.shape[0], max_new_tokens), PAD)
        for i, text in enumerate(texts):
            tokens = [EOS if c == "§" else CHARS.encode(c)[0] for c in text][:max_new_tokens]
            new[i, : len(tokens)] = torch.tensor(tokens)
        return SimpleNamespace(input_ids=torch.cat([ids, new], 1))

    return sample


def prompts(*texts: str) -> tuple[torch.Tensor, torch.Tensor]:
    return mt.left_padded([CHARS.encode(t) for t in texts], PAD)


def run(turns, *texts, **tools):
    runner, seen = StandInTools(), []
    session = mt.ToolSession(ToolsConfig(show_schemas=False, **tools), runner, CHARS)
    ids, mask = prompts(*texts)
    cfg = PPOConfig(max_new_tokens=80, samples_per_prompt=1)
    batch = mt.rollout(None, ids, mask, cfg, session, None, scripted(turns, seen))
    return batch, runner, seen


def after_prompt(batch: mt.MultiTurnBatch, row: int, which: str = "trajectory") -> str:
    mask = batch.trajectory_mask if which == "trajectory" else batch.response_mask
    return CHARS.decode(batch.input_ids[row, 1:][mask[row].bool()])


CALL = tc.call_text("add", {"a": 1, "b": 2})


def test_a_call_is_answered_and_the_model_goes_on_after_the_result():
    batch, runner, seen = run([[CALL + "junk", "10§junk"], ["3§"]], "1+2=", "5+5=", max_turns=3)
    assert runner.requests == [[{"name": "add", "arguments": {"a": 1, "b": 2}}]]
    assert after_prompt(batch, 0) == CALL + "<tool_response>3</tool_response>3</s>"
    assert after_prompt(batch, 0, "response") == CALL + "3</s>"  # the result is no response token
    assert after_prompt(batch, 1) == "10</s>"
    assert seen[1] == ["1+2=" + CALL + "<tool_response>3</tool_response>"]  # turn 2: only the row still going
    assert batch.turns.tolist() == [2, 1] and batch.calls.tolist() == [1, 0] and batch.malformed.tolist() == [0, 0]


def test_a_malformed_call_is_an_error_observation_and_the_model_may_try_again():
    bad = '<tool_call>{"name": add}</tool_call>'
    batch, runner, seen = run([[bad], [CALL], ["3§"]], "1+2=", max_turns=3)
    text = after_prompt(batch, 0)
    assert text.startswith(bad + "<tool_response>error: not JSON: Expecting value at character 9</tool_response>")
    assert text.endswith(CALL + "<tool_response>3</tool_response>3</s>")
    assert runner.requests == [[{"name": "add", "arguments": {"a": 1, "b": 2}}]]
    assert batch.calls.tolist() == [2] and batch.malformed.tolist() == [1] and batch.turns.tolist() == [3]


def test_an_answer_that_ends_inside_an_unclosed_call_is_final_and_counted_malformed():
    batch, runner, _ = run([['<tool_call>{"name": "add"§junk']], "1+2=", max_turns=3)
    assert after_prompt(batch, 0) == '<tool_call>{"name": "add"</s>' and runner.requests == []
    assert (batch.turns.tolist(), batch.calls.tolist(), batch.malformed.tolist()) == ([1], [1], [1])


def test_max_turns_ends_a_trajectory_after_its_last_observation():
    batch, _, _ = run([[CALL], [CALL]], "1+2=", max_turns=2)
    assert after_prompt(batch, 0) == (CALL + "<tool_response>3</tool_response>") * 2
    assert batch.turns.tolist() == [2]


def test_the_token_budget_cuts_turns_and_observations():
    batch, _, _ = run([[CALL + "junk"]], "1+2=", max_turns=3, max_total_tokens=len(CALL) + 5)
    assert after_prompt(batch, 0) == CALL + "<tool"
    assert after_prompt(batch, 0, "response") == CALL
    short, _, _ = run([["x" * 30]], "1+2=", max_turns=3, max_total_tokens=12)
    assert after_prompt(short, 0) == "x" * 12 and short.turns.tolist() == [1]


def test_without_a_call_the_loop_is_the_single_turn_rollout():
    texts = ["10§junk", "7§", "123"]  # EOS then more samples; EOS at once; no EOS at all
    batch, runner, _ = run([texts], "5+5=", "3+4=", "99+24=", max_turns=3)
    assert runner.requests == [] and batch.turns.tolist() == [1, 1, 1]
    ids, mask = prompts("5+5=", "3+4=", "99+24=")
    sampled = scripted([texts], [])(None, ids, mask, None, 80, 1, SimpleNamespace(start=ids.shape[1]))
    attention, response = response_masks(sampled.input_ids, mask, torch.full((3,), ids.shape[1]), EOS)
    width = batch.input_ids.shape[1]
    assert torch.equal(batch.input_ids * batch.attention_mask, (sampled.input_ids * attention)[:, :width])
    assert torch.equal(batch.attention_mask, attention[:, :width]) and not attention[:, width:].any()
    assert torch.equal(batch.response_mask, response[:, : width - 1])
    assert torch.equal(batch.trajectory_mask, batch.response_mask)


def test_a_turn_ends_at_the_close_tag_or_eos_whichever_is_first():
    tokens = CHARS.encode(CALL + "more")
    assert mt.end_of_turn(tokens, CHARS, EOS) == len(CALL)
    assert mt.end_of_turn(CHARS.encode("ab") + [EOS] + tokens, CHARS, EOS) == 3
    assert mt.end_of_turn(CHARS.encode("plain"), CHARS, EOS) == 5
    stop = mt.EndedAtText(CHARS, tc.CALL_CLOSE, 2)
    rows = torch.tensor([CHARS.encode("ab" + CALL), CHARS.encode("ab" + CALL[:-1] + "x")])
    assert stop(rows, None).tolist() == [True, False]


@pytest.mark.parametrize(
    ("turn", "expected"),
    [
        ("the answer is 3", None),
        (CALL, tc.Call("add", {"a": 1, "b": 2})),
        ('x <tool_call> {"name": "add", "arguments": "{\\"a\\": 1}"} </tool_call>', tc.Call("add", {"a": 1})),
        ('<tool_call>{"name": "add"}</tool_call>', tc.Call("add", {})),
        ('<tool_call>{"name": "add", "arguments": {}', tc.Malformed("a call must end with </tool_call>")),
        ("<tool_call>[1]</tool_call>", tc.Malformed('a call is {"name": TOOL, "arguments": {...}}')),
        ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', tc.Malformed("arguments must be an object")),
    ],
)
def test_parse_reads_the_first_call_of_a_turn(turn, expected):
    assert tc.parse(turn) == expected


def test_the_tools_section_is_checked(tmp_path):
    with pytest.raises(ValueError, match="one or the other"):
        ToolsConfig(functions=[{"path": "t.py:add"}], environment="e.py:Env")
    with pytest.raises(ValueError, match="two tools named 'add'"):
        ToolsConfig(functions=[{"path": "t.py:add"}, {"path": "u.py:add"}])
    with pytest.raises(ValueError, match="expected FILE.py:CLASS"):
        ToolsConfig(environment="env.py")
    with pytest.raises(Exception, match="ppo.rollout_correction needs"):
        load_config(None, ["tools.environment=e.py:Env", "ppo.rollout_correction.kind=tis"])


def test_each_row_keeps_to_its_own_budget_and_results_are_cut_to_max_result_tokens():
    wide = tc.call_text("add", {"a": 10, "b": 20})  # 2 characters longer than CALL; its result "30" 1 longer
    budget = len(CALL) + len("<tool_response>3</tool_response>") + 4
    batch, _, seen = run([[CALL, wide], ["x" * 9, "y" * 9]], "1+2=", "10+20=", max_turns=3, max_total_tokens=budget)
    assert after_prompt(batch, 0) == CALL + "<tool_response>3</tool_response>xxxx"
    assert after_prompt(batch, 1) == wide + "<tool_response>30</tool_response>y"  # 4 - 3 left
    cut, _, _ = run([[wide]], "10+20=", max_turns=1, max_result_tokens=1)
    assert after_prompt(cut, 0) == wide + "<tool_response>3</tool_response>"


@pytest.mark.integration
@pytest.mark.parametrize("engine", ["hf", "compiled"])
def test_through_the_real_rollout_a_loop_without_calls_samples_what_the_single_turn_rollout_does(engine):
    """The tiny OPT on DeepSpeed's rollout path (the ppo stage's): with the same seed, the turn loop (prompts
    repeated up front, one sample each, the close-tag criterion added) samples the single-turn tokens — with
    each generate-loop engine (ppo.rollout.engine: the compiled one keeps the stop string and the budgets)."""
    from kubealign.rl.rollout import generate
    from kubealign.stages.ppo_models import build_models
    from kubealign.training import distributed

    distributed.init()
    cfg = PPOConfig(algorithm="grpo", samples_per_prompt=2, max_new_tokens=12, actor_zero_stage=0, dtype="fp32")
    models, _ = build_models(cfg, "tiny-opt", None, None, 1, 1.0)
    models.engine = engine
    tokenizer = models.tokenizer
    texts = ["\n\nHuman: What is 1 + 2?\n\nAssistant:", "\n\nHuman: Hi!\n\nAssistant:"]
    ids, mask = mt.left_padded([tokenizer(t).input_ids for t in texts], tokenizer.pad_token_id)
    torch.manual_seed(7)
    single = generate(models, ids, mask, cfg)
    runner = StandInTools()
    session = mt.ToolSession(ToolsConfig(functions=[{"path": "t.py:add"}], show_schemas=False), runner, tokenizer)
    torch.manual_seed(7)
    multi = mt.rollout(models, ids, mask, cfg, session)
    attention, response = response_masks(
        single.input_ids, mask.repeat_interleave(2, 0), single.response_start_idx, tokenizer.eos_token_id
    )
    for row in range(4):
        expected = single.input_ids[row, ids.shape[1] :][attention[row, ids.shape[1] :].bool()].tolist()
        got = multi.input_ids[row, ids.shape[1] :][multi.attention_mask[row, ids.shape[1] :].bool()].tolist()
        assert got == expected and len(got) > 0
    assert runner.requests == [] and multi.turns.tolist() == [1, 1, 1, 1]
    assert multi.response_mask.sum().item() == response.sum().item()


def test_an_environments_rewards_add_to_the_scores_and_count_as_scored():
    from kubealign.rl.experience import Experience

    zeros = torch.zeros(3, 4)
    exp = Experience(zeros, zeros, zeros, zeros, zeros, None, torch.tensor([1.0, 2.0, 0.0]), None)
    out = mt.with_environment_rewards(exp, [0.5, None, -1.0])
    assert out.scores.tolist() == [1.5, 2.0, -1.0] and out.scored is None
    partly = exp._replace(scored=torch.tensor([False, True, False]))
    assert mt.with_environment_rewards(partly, [0.5, None, None]).scored.tolist() == [True, True, False]
    assert mt.with_environment_rewards(exp, None) is exp
