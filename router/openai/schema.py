"""Every request field OpenAI or vLLM defines for ``/v1/chat/completions`` and
``/v1/completions``, and what splitserve does with it: the one table the HTTP
front door checks requests against and ``docs/api.md`` is generated from
(``python -m splitserve.router.openai.schema > docs/api.md``).

A field is

- ``honoured``: it does what OpenAI / vLLM document;
- ``metadata``: accepted and has no effect on the output (as in OpenAI, where it
  only labels the request);
- ``refused``: a request that sets it to anything but its *neutral* value (the
  value that asks for nothing: ``n: 1``, ``presence_penalty: 0``) gets a 400
  naming it. Nothing is accepted and silently ignored.

A field in neither table is *unknown*: a 400 listing it, unless the router runs
with ``router.openai.ignore_unknown_fields`` (then it is logged and counted).
"""

from __future__ import annotations

import enum
import json
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from splitserve.wire.sampling import MAX_N


class Status(str, enum.Enum):
    HONOURED = "honoured"
    METADATA = "metadata"
    REFUSED = "refused"


class Endpoint(str, enum.Enum):
    CHAT = "chat"
    COMPLETIONS = "completions"


PATHS = {Endpoint.CHAT: "/v1/chat/completions", Endpoint.COMPLETIONS: "/v1/completions"}
BOTH = (Endpoint.CHAT, Endpoint.COMPLETIONS)
CHAT = (Endpoint.CHAT,)
COMPLETIONS = (Endpoint.COMPLETIONS,)
_ABSENT = (None,)


@dataclass(frozen=True)
class ApiField:
    name: str
    endpoints: tuple[Endpoint, ...]
    status: Status
    note: str  # what splitserve does with it (honoured, metadata) or why it is refused
    neutral: tuple[Any, ...] = _ABSENT  # values a refused field may take: they ask for nothing
    origin: str = "OpenAI"  # who defines it: OpenAI, vLLM or splitserve

    def accepts(self, value: Any) -> bool:
        """Whether a request may carry this value (always, unless the field is refused)."""
        return self.status is not Status.REFUSED or any(_same(value, n) for n in self.neutral)


def _same(a: Any, b: Any) -> bool:
    """Equal, and not a bool equal to a number (``False == 0`` in Python)."""
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def _h(name: str, where, note: str, origin: str = "OpenAI") -> ApiField:
    return ApiField(name, where, Status.HONOURED, note, origin=origin)


def _m(name: str, where, note: str, origin: str = "OpenAI") -> ApiField:
    return ApiField(name, where, Status.METADATA, note, origin=origin)


def _r(name: str, where, note: str, neutral: tuple = _ABSENT, origin: str = "OpenAI") -> ApiField:
    return ApiField(name, where, Status.REFUSED, note, (None, *neutral), origin)


_NOT_YET = "not supported yet"

FIELDS: tuple[ApiField, ...] = (
    # ---- what a request is --------------------------------------------------------------
    _h("messages", CHAT, "rendered with the model's chat template; text content only"),
    _h("prompt", COMPLETIONS, "text or a list of token ids (one prompt)"),
    _h("model", BOTH, "must be the served model's name, or empty"),
    _h("stream", BOTH, "server-sent events, one chunk per decode step"),
    _h(
        "stream_options",
        BOTH,
        "`include_usage` (a last chunk with usage) and `continuous_usage_stats` (usage in every chunk)",
    ),
    _h("request_id", BOTH, "the request's id (else one is made); unique among live requests", "vLLM"),
    # ---- how long ---------------------------------------------------------------------------
    _h(
        "max_tokens",
        BOTH,
        "unset: the rest of the context (chat) or 16 (completions), as in vLLM; never more than the "
        "context allows (400)",
    ),
    _h("max_completion_tokens", CHAT, "as `max_tokens` (wins over it)"),
    _h("stop", BOTH, "a string or a list of strings; the output ends before the first one it produces"),
    _h("stop_token_ids", BOTH, "the output ends after any of these tokens", "vLLM"),
    _h("ignore_eos", BOTH, "generate past the end-of-sequence token until `max_tokens`", "vLLM"),
    # ---- sampling -------------------------------------------------------------------------
    _h(
        "temperature",
        BOTH,
        "in [0, 100], 0 is greedy (wider than OpenAI's [0, 2], which would refuse vLLM clients' values; past "
        "100 any model's distribution is as flat as float32 tells); under 0.01 sampled as 0.01 (vLLM's "
        "floor); unset: the model's `generation_config.json`, else 1.0",
    ),
    _h("top_p", BOTH, "unset: the model's `generation_config.json`, else 1.0 (off)"),
    _h(
        "top_k",
        BOTH,
        "an integer < 2^31, past the vocabulary: all; unset: the model's `generation_config.json`, "
        "else 0 (off)",
        "vLLM",
    ),
    _h("seed", BOTH, "in [0, 2^64): reproducible sampling, the same output whatever else is in the batch"),
    _h(
        "n",
        BOTH,
        f"1 to {MAX_N} choices of one prompt, handed over once and forked on the decode worker; "
        "choice i is seeded `seed + i`",
    ),
    _r("best_of", BOTH, "not supported (vLLM's V1 engine dropped it too)", (1,)),
    _r("use_beam_search", BOTH, "beam search is not supported", (False,), "vLLM"),
    _r("length_penalty", BOTH, "only for beam search, which is not supported", (1, 1.0), "vLLM"),
    _h("presence_penalty", BOTH, "in [-2, 2]: minus it from each token already in the output"),
    _h("frequency_penalty", BOTH, "in [-2, 2]: minus it times each token's count in the output"),
    _h(
        "repetition_penalty",
        BOTH,
        "in (0, 100], over prompt and output tokens (vLLM's, transformers'); unset: as top_p, else 1",
        "vLLM",
    ),
    _h(
        "min_p",
        BOTH,
        "drop tokens under min_p x the top one's probability; unset: as top_p, else 0",
        "vLLM",
    ),
    _h("logit_bias", BOTH, "token id -> added to its logit, in [-100, 100]"),
    _h("min_tokens", BOTH, "EOS and `stop_token_ids` held back until this many tokens", "vLLM"),
    _h("bad_words", BOTH, "never generated: each word as tokenized and after a space", "vLLM"),
    _h("allowed_token_ids", BOTH, "every other token is masked", "vLLM"),
    _h(
        "include_stop_str_in_output",
        BOTH,
        "the stop string (or stop token) that ended the output stays in its text",
        "vLLM",
    ),
    _h("skip_special_tokens", BOTH, "false: special tokens' text is kept in the output text", "vLLM"),
    _h(
        "speculate",
        BOTH,
        "false: a worker that speculates decodes this request without (the tokens are the same)",
        "splitserve",
    ),
    _r(
        "spaces_between_special_tokens",
        BOTH,
        "special tokens are always skipped in the text",
        (True,),
        "vLLM",
    ),
    _r("logits_processors", BOTH, "custom logits processors are not supported", ([],), "vLLM"),
    # ---- what comes back ------------------------------------------------------------------
    _h("logprobs", CHAT, "true: each chosen token's logprob (the model's raw distribution)"),
    _h("top_logprobs", CHAT, "with `logprobs`: also the 0-20 most likely tokens' at each step"),
    _h("logprobs", COMPLETIONS, "0-20: each chosen token's logprob and this many most likely tokens'"),
    _h(
        "prompt_logprobs",
        BOTH,
        "each prompt token's logprob and the k most likely at its position, in `choices[].prompt_logprobs`"
        " (vLLM's shape); not with `stream`",
        "vLLM",
    ),
    _h("echo", COMPLETIONS, "the prompt before the completion; with `logprobs`, the prompt tokens' too"),
    _r("echo", CHAT, "vLLM's chat echo (of the last message) is not supported", (False,)),
    _r("suffix", COMPLETIONS, "insertion (fill-in-the-middle) is not supported", ("",)),
    _r("return_tokens_as_token_ids", BOTH, "not supported", (False,), "vLLM"),
    _r("return_token_ids", BOTH, "not supported", (False,), "vLLM"),
    _r("modalities", CHAT, "text output only", (["text"],)),
    _r("audio", CHAT, "text output only"),
    _r("prediction", CHAT, "predicted outputs are not supported"),
    _r("verbosity", CHAT, "not supported"),
    # ---- structured output, tools, reasoning --------------------------------------------
    _h(
        "response_format",
        BOTH,
        "`text`, `json_object` or `json_schema` (always strict): every token keeps the output valid",
    ),
    _h(
        "structured_outputs",
        BOTH,
        "one of `json` (a schema), `regex`, `choice`, `grammar` (Lark), `json_object` (llguidance)",
        "vLLM",
    ),
    _r("guided_json", BOTH, "vLLM's older name; use `response_format`", (), "vLLM"),
    _r("guided_regex", BOTH, "vLLM's older name; use `structured_outputs`", (), "vLLM"),
    _r("guided_choice", BOTH, "vLLM's older name; use `structured_outputs`", (), "vLLM"),
    _r("guided_grammar", BOTH, "vLLM's older name; use `structured_outputs`", (), "vLLM"),
    _r("guided_decoding_backend", BOTH, "vLLM's older name; use `structured_outputs`", (), "vLLM"),
    _r("guided_whitespace_pattern", BOTH, "vLLM's older name; use `structured_outputs`", (), "vLLM"),
    _h("tools", CHAT, "function tools, shown to the model by its chat template"),
    _h(
        "tool_choice",
        CHAT,
        "`none` (tools not shown), `auto` (calls parsed from the output: `router.openai.tool_call_parser`, "
        "hermes or llama3_json), `required` or a named function (held to a valid call by structured output)",
    ),
    _h("parallel_tool_calls", CHAT, "false: `required` makes exactly one call"),
    _r("functions", CHAT, "deprecated by OpenAI; use `tools`", ([],)),
    _r("function_call", CHAT, "deprecated by OpenAI; use `tool_choice`", ("none", "auto")),
    _h("reasoning_effort", CHAT, "passed to the chat template as the variable `reasoning_effort`"),
    _h(
        "include_reasoning",
        CHAT,
        "false drops `reasoning_content` (with `router.openai.reasoning_parser` think or harmony)",
        "vLLM",
    ),
    _r("web_search_options", CHAT, "web search is not supported"),
    # ---- the prompt ---------------------------------------------------------------------
    _h(
        "chat_template",
        CHAT,
        "a Jinja chat template for this request (else `router.chat_template`)",
        "vLLM",
    ),
    _h("chat_template_kwargs", CHAT, "more template variables, e.g. `enable_thinking`", "vLLM"),
    _r("add_generation_prompt", CHAT, "always added", (True,), "vLLM"),
    _r("continue_final_message", CHAT, "not supported", (False,), "vLLM"),
    _r("add_special_tokens", CHAT, "the chat template places special tokens", (False,), "vLLM"),
    _r(
        "add_special_tokens",
        COMPLETIONS,
        "the tokenizer's own special tokens are always added",
        (True,),
        "vLLM",
    ),
    _r("documents", CHAT, "not supported", ([],), "vLLM"),
    _r("mm_processor_kwargs", CHAT, "text-only models", ({},), "vLLM"),
    _r("truncate_prompt_tokens", BOTH, "prompts are never truncated: a long one gets a 400", (), "vLLM"),
    _r("prompt_embeds", COMPLETIONS, "not supported", (), "vLLM"),
    # ---- serving -----------------------------------------------------------------------
    _m("user", BOTH, "an end-user id; no effect on the output"),
    _m("metadata", CHAT, "labels; no effect on the output"),
    _m("safety_identifier", CHAT, "an end-user id; no effect on the output"),
    _m("prompt_cache_key", CHAT, "no effect: the router finds cached prefixes by their tokens"),
    _r("store", CHAT, "stored completions are not supported", (False,)),
    _r("service_tier", CHAT, "one tier", ("auto", "default")),
    _r("priority", BOTH, "requests are served in arrival order", (0,), "vLLM"),
    _r("cache_salt", BOTH, "not supported", (), "vLLM"),
    _r("kv_transfer_params", BOTH, "the router places the KV itself", (), "vLLM"),
    _r("vllm_xargs", BOTH, "not supported", (), "vLLM"),
)


def fields_of(endpoint: Endpoint) -> dict[str, ApiField]:
    """The table for one endpoint, by field name."""
    return {f.name: f for f in FIELDS if endpoint in f.endpoints}


@dataclass(frozen=True)
class Verdict:
    """What the table says about the fields a request carries."""

    refused: tuple[str, ...]  # known, refused, set to a value that is not neutral
    unknown: tuple[str, ...]  # in neither OpenAI's nor vLLM's definition


def check(endpoint: Endpoint, body: Mapping[str, Any], honoured: Iterable[str]) -> Verdict:
    """Check the fields of ``body`` that the front door's own model does not read
    (``honoured``: the names it does)."""
    table = fields_of(endpoint)
    seen = set(honoured)
    refused = [k for k, v in body.items() if k not in seen and k in table and not table[k].accepts(v)]
    unknown = [k for k in body if k not in seen and k not in table]
    return Verdict(tuple(refused), tuple(unknown))


def refusal(endpoint: Endpoint, verdict: Verdict) -> str | None:
    """The 400's sentence for ``verdict``, or None when nothing is wrong."""
    parts = []
    if verdict.refused:
        table = fields_of(endpoint)
        parts.append(
            "not supported by this server: " + "; ".join(f"`{k}` ({table[k].note})" for k in verdict.refused)
        )
    if verdict.unknown:
        parts.append(
            "unknown fields: "
            + ", ".join(f"`{k}`" for k in verdict.unknown)
            + f" (neither OpenAI nor vLLM defines them for {PATHS[endpoint]})"
        )
    return "; ".join(parts) or None


def markdown() -> str:
    """``docs/api.md``: the table above, one row per field and endpoint."""
    out = [
        "# The OpenAI-compatible API: every field",
        "",
        "Generated from `router/openai/schema.py`",
        "(`python -m splitserve.router.openai.schema > docs/api.md`); a test fails when the two",
        "differ. **honoured**: does what OpenAI / vLLM document. **metadata**:",
        "accepted, no effect on the output. **refused**: a request setting it to anything but a neutral",
        "value (listed) gets HTTP 400 naming the field. A field in neither table gets a 400 listing it,",
        "unless the router runs with `router.openai.ignore_unknown_fields: true` (then a warning per",
        "field in the log and `splitserve:ignored_fields_total`).",
        "",
    ]
    for endpoint in Endpoint:
        out += [f"## `POST {PATHS[endpoint]}`", "", _HEADER, "|---|---|---|---|---|"]
        for f in sorted(fields_of(endpoint).values(), key=lambda f: (f.status.value, f.name)):
            neutral = ", ".join(_show(v) for v in f.neutral[1:]) if f.status is Status.REFUSED else ""
            out.append(f"| `{f.name}` | {f.origin} | {f.status.value} | {neutral} | {f.note} |")
        out.append("")
    return "\n".join(out)


_HEADER = "| field | from | status | neutral | what splitserve does |"


def _show(value: Any) -> str:
    return f"`{json.dumps(value)}`"


if __name__ == "__main__":
    sys.stdout.write(markdown())
