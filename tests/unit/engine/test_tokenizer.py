"""``engine.tokenizer``: a chat template's own refusal is the client's error (a 400
with the template's words), not a server error."""

from __future__ import annotations

import jinja2
import pytest

from splitserve.engine.tokenizer import Tokenizer
from splitserve.router.openai.protocol import ChatRequest
from splitserve.wire.chat import ChatTemplating
from splitserve.wire.errors import InvalidRequest
from splitserve.wire.validation import RequestValidator


class _AlternatingTemplate:
    """A Hugging Face tokenizer whose chat template insists that roles alternate (as
    Mistral's and Llama-2's do), by raising from inside the template like them."""

    chat_template = "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, **_):
        env = jinja2.Environment()

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        env.from_string(self.chat_template).render(messages=messages)
        return [1, 2, 3]


def test_a_template_refusal_is_an_invalid_request_with_its_words():
    tokenizer = Tokenizer(_AlternatingTemplate())
    with pytest.raises(InvalidRequest, match="roles must alternate"):
        tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


VARIABLES_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}/no_think\n{% endif %}"
    "{% if reasoning_effort is defined %}effort={{ reasoning_effort }}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def test_a_requests_template_tools_and_variables_render(smollm2):
    """What a chat request sets (``tools``, ``chat_template``, ``chat_template_kwargs``,
    ``reasoning_effort``) reaches the template; the server's template
    (``router.chat_template``) stands in for the model's unless the request names its own."""
    _, hf = smollm2
    tok = Tokenizer(hf)
    messages = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    request = ChatRequest(
        messages=messages,
        tools=[tool],
        chat_template=VARIABLES_TEMPLATE,
        chat_template_kwargs={"enable_thinking": False},
        reasoning_effort="low",
    )
    ids = tok.apply_chat_template(request.template_messages(), request.templating())
    assert hf.decode(ids) == "TOOLS:get_time;/no_think\neffort=low\nuser: hi\nassistant:"  # trim_blocks
    no_tools = request.model_copy(update={"tool_choice": "none"})
    assert "TOOLS" not in hf.decode(tok.apply_chat_template(messages, no_tools.templating()))
    # the server's template, unless the request names one; the model's without either
    validator = RequestValidator("m", hf.vocab_size, 4096, 4096, tok, chat_template=VARIABLES_TEMPLATE)
    assert hf.decode(validator.encode(None, messages)) == "user: hi\nassistant:"
    own = ChatTemplating(template="{{ messages[0].content }}!")
    assert hf.decode(validator.encode(None, messages, own)) == "hi!"
    model_default = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert hf.decode(RequestValidator("m", hf.vocab_size, 4096, 4096, tok).encode(None, messages)) == (
        model_default
    )
    with pytest.raises(InvalidRequest, match="may not set tokenize"):
        ChatTemplating(variables={"tokenize": False})
