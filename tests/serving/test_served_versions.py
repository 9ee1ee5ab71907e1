"""Which version a server serves, from its /v1/models (kubealign.serving.identity, issue 54), on payloads written
by hand as vLLM answers them: the judge refuses to act on answers from a server that does not serve the version
the registry says."""

from __future__ import annotations

import pytest

from kubealign.serving.identity import problem, version_name
from tests.stages.test_judge import listing

pytestmark = pytest.mark.unit


def test_the_right_version_under_the_asked_name_passes() -> None:
    assert version_name("actor", "2") == "models:/actor/2"
    assert problem(listing("actor", "2"), "actor", "2", "actor") is None
    # in the cluster the judge asks the name the server gives first (the InferenceService's)
    assert problem(listing("actor", "2", first="isvc"), "actor", "2", "isvc") is None
    assert problem(listing("actor", "2", first="isvc"), "actor", "2", "actor") == (
        "does not answer to 'actor' (it serves 'isvc', 'models:/actor/2')"
    )


def test_another_version_is_named_and_versions_are_compared_whole() -> None:
    assert problem(listing("actor", "3"), "actor", "2", "actor") == "serves 'models:/actor/3'"
    assert problem(listing("actor", "11"), "actor", "1", "actor") == "serves 'models:/actor/11'"  # not a prefix
    assert problem(listing("actor", "1"), "actor", "11", "actor") == "serves 'models:/actor/1'"
    suffixed = {"data": [{"id": "actor"}, {"id": "models:/actor/2b"}]}  # a name that starts like version 2's
    assert problem(suffixed, "actor", "2", "actor") == "serves 'actor', 'models:/actor/2b', naming no version of actor"
    # another registered model's version 2 is no version of this one (nor one whose name this one prefixes)
    assert problem(listing("actor-b", "2"), "actor", "2", "actor-b") == (
        "serves 'actor-b', 'models:/actor-b/2', naming no version of actor"
    )


def test_a_server_that_names_no_version_or_lists_nothing() -> None:
    assert problem({"data": [{"id": "isvc-name"}]}, "actor", "2", "isvc-name") == (
        "serves 'isvc-name', naming no version of actor"
    )
    assert problem({"object": "list"}, "actor", "2", "actor").startswith("lists no served model in /v1/models")
    assert problem({"data": []}, "actor", "2", "actor").startswith("lists no served model")
    assert problem({"data": [{"object": "model"}]}, "actor", "2", "actor").startswith("lists no served model")
    assert problem(["actor"], "actor", "2", "actor").startswith("lists no served model")
    # one that names no model URI at all (KServe's huggingface runtime) is unchecked, not refused; a malformed
    # URI, or another model's, is a name that says something else: refused
    from kubealign.serving.identity import names_no_version

    assert names_no_version({"data": [{"id": "isvc-name"}]}) and names_no_version({"data": [{"id": "a"}, {"id": "b"}]})
    assert not names_no_version({"data": [{"id": "isvc-name"}, {"id": "models:/actor/2b"}]})
    assert not names_no_version(listing("actor-b", "2")) and not names_no_version({"data": []})
    assert not names_no_version({"object": "list"}) and not names_no_version(listing("actor", "2"))


def test_two_models_served_are_told_apart() -> None:
    both = listing("actor", "2")
    both["data"] += listing("actor", "3")["data"][1:]  # a second version's name beside the first
    assert problem(both, "actor", "2", "actor") == "serves several versions ('models:/actor/2', 'models:/actor/3')"
    # the asked name answers from another directory than the version named: the judge would ask another model
    other = listing("actor", "2")
    other["data"][0]["root"] = "/cache/served/actor/1/model"
    assert problem(other, "actor", "2", "actor") == (
        "answers to 'actor' from '/cache/served/actor/1/model', not from models:/actor/2's '/cache/served/actor/2/model'"
    )
    # a LoRA adapter beside the base model (vLLM lists it with its own root): the asked name is still the version's
    lora = listing("actor", "2")
    lora["data"].append({"id": "adapter", "root": "/adapters/a", "parent": "actor"})
    assert problem(lora, "actor", "2", "actor") is None


def test_check_passes_leaves_unnamed_servers_unchecked_and_refuses_another_version(monkeypatch) -> None:
    from kubealign.errors import UserError
    from kubealign.serving import ask, identity

    served = {"http://a": listing("actor", "1"), "http://b": listing("actor", "2"), "http://c": {"data": [{"id": "i"}]}}
    monkeypatch.setattr(ask, "models", lambda url: served[url])
    asked = {"champion": "actor", "canary": "actor"}
    expected = {"champion": "1", "canary": "2"}
    assert identity.check({"champion": "http://a", "canary": "http://b"}, expected, "actor", asked) == [
        "pass: champion http://a serves models:/actor/1 (the registry's champion)",
        "pass: canary http://b serves models:/actor/2 (the judged canary)",
    ]
    lines = identity.check({"champion": "http://a", "canary": "http://c"}, expected, "actor", asked)
    assert lines[1] == (
        "unchecked: canary http://c names no version in /v1/models (serve.runtime vllm does), the judged canary is "
        "version 2"
    )
    with pytest.raises(
        UserError, match=r"^judge: http://a serves 'models:/actor/1' but the judged canary is version 2"
    ):
        identity.check({"champion": "http://a", "canary": "http://a"}, expected, "actor", asked)
