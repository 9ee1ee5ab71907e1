"""Normalization of every recognized row schema to {prompt, chosen, rejected}."""

from __future__ import annotations

import gzip
import json

import pytest

from kubealign.data.schemas import Pair, RowDrop, RowError, detect_format, normalize, row_problem


def test_prompt_chosen_rejected_ignores_extra_keys():
    row = {"prompt": "\n\nHuman: hi\n\nAssistant:", "response": " a", "chosen": " a", "rejected": " b"}
    assert detect_format(row) == "prompt_chosen_rejected"
    assert normalize(row) == Pair("\n\nHuman: hi\n\nAssistant:", " a", " b")


def test_prompt_chosen_without_rejected_is_sft_only():
    assert normalize({"prompt": "p", "chosen": "c"}) == Pair("p", "c", None)
    assert normalize({"prompt": "p", "chosen": "c", "rejected": None}) == Pair("p", "c", None)


def test_prompt_response():
    row = {"prompt": "p", "response": "r"}
    assert detect_format(row) == "prompt_response"
    assert normalize(row) == Pair("p", "r", None)


def test_hh_dialogues_split_at_the_last_assistant_turn():
    shared = "\n\nHuman: a?\n\nAssistant: b\n\nHuman: c?\n\nAssistant:"
    row = {"chosen": shared + " yes", "rejected": shared + " no"}
    assert detect_format(row) == "hh"
    assert normalize(row) == Pair(shared, " yes", " no")


def test_hh_prompt_mismatch_is_a_drop_not_an_error():
    row = {"chosen": "\n\nHuman: a\n\nAssistant: x", "rejected": "\n\nHuman: b\n\nAssistant: y"}
    with pytest.raises(RowDrop) as info:
        normalize(row, "hh")
    assert info.value.reason == "prompt_mismatch"


def test_hh_without_assistant_turn_names_the_field():
    with pytest.raises(RowError) as info:
        normalize({"chosen": "no turns here", "rejected": "\n\nAssistant: x"}, "hh")
    assert info.value.field == "chosen"


def test_messages_sft_row_renders_the_plain_format():
    row = {
        "messages": [
            {"role": "system", "content": "Be kind."},
            {"role": "user", "content": "Hi?"},
            {"role": "assistant", "content": "Hello."},
        ]
    }
    assert normalize(row) == Pair("\n\nSystem: Be kind.\n\nHuman: Hi?\n\nAssistant:", " Hello.", None)


def test_messages_preference_pair():
    user = {"role": "user", "content": "Q"}
    row = {
        "chosen": [user, {"role": "assistant", "content": "good"}],
        "rejected": [user, {"role": "assistant", "content": "bad"}],
    }
    assert detect_format(row) == "messages"
    assert normalize(row) == Pair("\n\nHuman: Q\n\nAssistant:", " good", " bad")


@pytest.mark.parametrize(
    ("row", "fmt", "field", "message"),
    [
        ({"prompt": "p", "chosen": 5}, "auto", "chosen", "expected a string, got int"),
        ({"prompt": None, "response": "r"}, "auto", "prompt", "expected a string, got null"),
        ({"prompt": "p"}, "prompt_response", "response", "missing"),
        ({"text": "x"}, "auto", None, "no recognizable fields"),
        ({"messages": [{"role": "user", "content": "q"}]}, "auto", "messages[0].role", "last message"),
        ({"messages": [{"role": "bot", "content": "q"}]}, "auto", "messages[0].role", "expected one of"),
        ({"messages": [{"role": "user", "content": 3}]}, "auto", "messages[0].content", "expected a string"),
        ({"messages": "hi"}, "auto", "messages", "non-empty list"),
    ],
)
def test_malformed_rows_name_the_field(row, fmt, field, message):
    with pytest.raises(RowError) as info:
        normalize(row, fmt)
    assert info.value.field == field
    assert message in info.value.message


def test_non_object_row():
    with pytest.raises(RowError, match="expected a JSON object, got list"):
        normalize([1, 2])


@pytest.mark.parametrize(
    ("pair", "reason"),
    [
        (Pair(" ", "c", "r"), "empty_prompt"),
        (Pair("p", "\n", "r"), "empty_chosen"),
        (Pair("p", "c", "  "), "empty_rejected"),
        (Pair("p", " same", "same "), "chosen_equals_rejected"),
        (Pair("p", "c", "r"), None),
        (Pair("p", "c", None), None),
    ],
)
def test_row_problems(pair, reason):
    assert row_problem(pair) == reason


def test_real_hh_rows_normalize_losslessly(hh_file):
    with gzip.open(hh_file, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for _, line in zip(range(50), f, strict=False)]
    for row in rows:
        pair = normalize(row)
        assert pair.prompt.endswith("\n\nAssistant:")
        assert pair.prompt.startswith("\n\nHuman:")
        assert pair.prompt + pair.chosen == row["chosen"]
        assert pair.prompt + pair.rejected == row["rejected"]
        assert "\n\nAssistant:" not in pair.chosen


# --- TRL's prompt-completion rows, and prompt-only rows that carry an answer ------------------------------


def test_prompt_completion_is_a_demonstration():
    assert normalize({"prompt": "Q: 2+2?", "completion": " 4"}) == Pair("Q: 2+2?", " 4", None)
    assert normalize({"prompt": "Q", "completion": " A"}, "prompt_completion") == Pair("Q", " A", None)


def test_conversational_prompt_completion_renders_as_messages_do():
    row = {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
        "completion": [{"role": "assistant", "content": "4"}],
    }
    same = {"messages": [*row["prompt"], *row["completion"]]}
    assert normalize(row) == Pair("\n\nSystem: Be brief.\n\nHuman: 2+2?\n\nAssistant:", " 4", None) == normalize(same)


@pytest.mark.parametrize(
    ("row", "field", "message"),
    [
        (
            {
                "prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                "completion": [{"role": "assistant", "content": "c"}],
            },
            "prompt[1].role",
            "must end before the assistant",
        ),
        (
            {"prompt": [{"role": "user", "content": "a"}], "completion": [{"role": "user", "content": "c"}]},
            "completion",
            "expected one assistant message",
        ),
        (
            {
                "prompt": [{"role": "user", "content": "a"}],
                "completion": [{"role": "assistant", "content": "c"}, {"role": "assistant", "content": "d"}],
            },
            "completion",
            "expected one assistant message",
        ),
        ({"prompt": "a", "completion": 4}, "completion", "expected a string, got int"),
        (
            {"prompt": [{"role": "user", "content": 1}], "completion": [{"role": "assistant", "content": "c"}]},
            "prompt[0].content",
            "expected a string, got int",
        ),
    ],
)
def test_bad_prompt_completion_rows_name_the_field(row, field, message):
    with pytest.raises(RowError) as err:
        normalize(row)
    assert err.value.field == field and message in err.value.message


@pytest.mark.parametrize("key", ["answer", "output", "text", "solution", "Answer"])
def test_a_prompt_only_row_with_an_answer_like_field_is_refused_unless_declared(key):
    row = {"prompt": "2+2?", key: "4", "level": 1}
    with pytest.raises(RowError) as err:
        normalize(row)
    assert err.value.field == key and "list it in the source's `columns`" in err.value.message
    with pytest.raises(RowError):
        normalize(row, "prompt_only")  # the explicit format too
    assert normalize(row, columns=frozenset({key})).columns == json.dumps({key: "4", "level": 1}, sort_keys=True)
    assert normalize({"prompt": "2+2?", "level": 1}).columns == '{"level": 1}'  # a plain column needs nothing


def test_a_prompt_only_row_keeps_its_prompt_and_json_columns_exactly():
    row = {"prompt": "¿2+2?", "hint": "cuatro é", "level": 1}
    assert normalize(row) == Pair("¿2+2?", None, None, '{"hint": "cuatro é", "level": 1}')  # not \\u escapes
    with pytest.raises(RowError, match="must be JSON values"):
        normalize({"prompt": "p", "level": float("nan")})


@pytest.mark.parametrize(
    ("row", "keys"),
    [
        ({"chosen": "only a chosen text"}, "chosen"),  # chosen alone is no HH pair
        ({"prompt": "p", "rejected": "r"}, "prompt, rejected"),  # a rejected answer with no chosen one
        ({}, "none"),
        ({f"k{i}": 1 for i in range(9)}, "k0, k1, k2, k3, k4, k5, k6, k7"),  # the first eight, sorted
    ],
)
def test_rows_no_schema_fits_name_their_keys(row, keys):
    with pytest.raises(RowError) as err:
        normalize(row)
    assert err.value.field is None
    assert err.value.message == (
        "no recognizable fields (expected prompt/chosen/rejected, chosen/rejected dialogues, prompt/response, "
        f"prompt/completion or messages; found keys: {keys})"
    )


def test_conversational_prompt_completion_errors_name_the_completion_field():
    with pytest.raises(RowError) as err:
        normalize({"prompt": [{"role": "user", "content": "a"}], "completion": []})
    assert (err.value.field, err.value.message) == ("completion", "expected a non-empty list of messages, got list")
    with pytest.raises(RowError) as err:
        normalize({"prompt": [{"role": "user", "content": "a"}], "completion": [{"role": "user", "content": "b"}]})
    assert (err.value.field, err.value.message) == ("completion", "expected one assistant message")
    with pytest.raises(RowError) as err:
        normalize(
            {
                "prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                "completion": [{"role": "assistant", "content": "c"}],
            }
        )
    assert (err.value.field, err.value.message) == (
        "prompt[1].role",
        "the prompt must end before the assistant's reply",
    )
    with pytest.raises(RowError) as err:
        normalize({"prompt": "p", "answer": "4"})
    assert err.value.message == (
        "looks like the row's answer, not a column: list it in the source's `columns` to give it to reward "
        "functions, or name it `completion` to train on it"
    )
