"""``engine.tokenizer``: a chat template's own refusal is the client's error (a 400
with the template's words), not a server error."""

from __future__ import annotations

import jinja2
import pytest

from splitserve.engine.tokenizer import Tokenizer
from splitserve.wire.errors import InvalidRequest


class _AlternatingTemplate:
    """A Hugging Face tokenizer whose chat template insists that roles alternate (as
    Mistral's and Llama-2's do), by raising from inside the template like them."""

    chat_template = "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
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
