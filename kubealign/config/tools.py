"""The `tools` section: tools and an environment the policy calls during its rollouts.

With tools set, grpo / rloo / ppo roll out in turns: the model writes until it closes a tool call (or ends its
answer), the call runs in the reward-function worker's sandbox (the `rewards` section's time, memory,
environment, file and network limits), its result is appended as an observation, and the model goes on, up
to `max_turns` turns and `max_total_tokens` tokens after the prompt. The format is the Hermes markup that
Qwen's and other chat templates use for tools:

    <tool_call>{"name": "calculator", "arguments": {"expression": "347 + 589"}}</tool_call>
    <tool_response>936</tool_response>

Observation tokens are the environment's, not the model's: they are masked out of the loss and the KL.
"""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from kubealign.config.base import Section


def check_reference(value: str, what: str) -> str:
    """FILE.py:WHAT or module:WHAT (WHAT an identifier), or a ValueError saying so (pydantic names the field)."""
    where, sep, name = value.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ValueError(f"expected FILE.py:{what} or module:{what}, got {value!r}")
    return value


class ToolFunction(Section):
    path: str = Field(
        description="FILE.py:NAME (relative to the config file) or module:NAME: a function with type hints and a "
        "docstring (its JSON schema is what the model is shown, as TRL's `tools`), called with the call's "
        "arguments as keywords; what it returns, as text, is the observation.",
        min_length=3,
    )

    @field_validator("path")
    @classmethod
    def _check_path(cls, value: str) -> str:
        return check_reference(value, "NAME")

    @property
    def name(self) -> str:
        return self.path.rpartition(":")[2]


class ToolsConfig(Section):
    """Tools (plain functions) or an environment (a class with reset(row) -> observation and step(action) ->
    (observation, reward, done), OpenEnv's shape) for multi-turn rollouts. Empty: one answer per prompt."""

    functions: list[ToolFunction] = Field(default_factory=list, description="Tools the model may call, in order.")
    environment: str | None = Field(
        None,
        description="FILE.py:CLASS or module:CLASS: an environment made per trajectory with CLASS(), then "
        "reset(row) (the prompt's data row, a dict) -> the first observation or None, and step(action) (the "
        "model's turn, text) -> (observation or None, reward or None, done). Its rewards are summed into the "
        "trajectory's score beside the reward functions.",
    )
    max_turns: int = Field(3, ge=1, le=32, description="Model turns per trajectory (a turn ends at a call or EOS).")
    max_total_tokens: int = Field(
        256, ge=1, description="Tokens after the prompt, model and observation tokens together, per trajectory."
    )
    max_result_tokens: int = Field(
        64, ge=1, description="Tokens of one observation kept (the rest cut, with the cut said in the text)."
    )
    show_schemas: bool = Field(
        True,
        description="Show the tools' JSON schemas to the model before each prompt (a <tools> block, Hermes's "
        "system text); off when the prompts describe the tools themselves.",
    )

    @field_validator("environment")
    @classmethod
    def _check_environment(cls, value: str | None) -> str | None:
        return None if value is None else check_reference(value, "CLASS")

    @model_validator(mode="after")
    def _check_names(self) -> ToolsConfig:
        names = [f.name for f in self.functions]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"two tools named {repeated[0]!r}: a call could not say which one it means")
        if self.functions and self.environment is not None:
            raise ValueError("tools.functions and tools.environment: one or the other (an environment answers turns)")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.functions) or self.environment is not None
