"""The chat template a served model needs. Pure but for the tokenizer it is given.

Training encodes a prompt with the tokenizer's own chat template when it has one, else as the plain dialogue
format ("\\n\\nHuman: ...\\n\\nAssistant:", kubealign.data.tokenize) with the BOS the tokenizer adds to plain
text. vLLM's chat route needs a template: the tokenizer's own, or this plain one, which renders messages as
training encoded them (tokenize.plain_to_messages reversed). Both `kubealign serve` (a file) and the vLLM
runtime's InferenceService (vLLM's --chat-template takes the template itself as well as a path) pass it.
"""

from __future__ import annotations

from typing import Any


def plain_template(bos: str | None) -> str:
    """A Jinja chat template that renders messages as training's plain format, with `bos` first (if any)."""
    start = "{{ bos_token }}" if bos else ""
    names = "{'user': 'Human', 'assistant': 'Assistant', 'system': 'System'}"
    return (
        f"{start}{{% set names = {names} %}}"
        "{% for m in messages %}{{ '\\n\\n' + names[m['role']] + ': ' + m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '\\n\\nAssistant:' }}{% endif %}"
    )


def template_for(tokenizer: Any) -> str | None:
    """None when the tokenizer has its own chat template (training used it); else the plain-format one."""
    if getattr(tokenizer, "chat_template", None):
        return None
    adds_bos = tokenizer.bos_token_id is not None and tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id]
    return plain_template(tokenizer.bos_token if adds_bos else None)
