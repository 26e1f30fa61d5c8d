"""What turns chat messages into a prompt besides the messages themselves."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from splitserve.wire.errors import InvalidRequest

# apply_chat_template's own parameters: a request's template variables may not set them
_RESERVED = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


@dataclass(frozen=True)
class ChatTemplating:
    """How a request's chat template is rendered: ``tools`` (OpenAI tool definitions,
    shown to the model by the template), ``template`` (a Jinja template in place of the
    server's), ``variables`` (more template variables: vLLM's ``chat_template_kwargs``,
    e.g. ``enable_thinking``)."""

    tools: list[dict[str, Any]] | None = None
    template: str | None = None
    variables: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        reserved = sorted(_RESERVED & self.variables.keys())
        if reserved:
            raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(reserved)}")
