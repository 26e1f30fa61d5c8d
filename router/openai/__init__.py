"""The router's OpenAI-compatible HTTP front door, beside its gRPC one: request
bodies (``protocol``, checked against every field OpenAI and vLLM define,
``schema``), the server (``server``), and answers in OpenAI's shapes
(``responses``, ``logprobs``). It stands on the request core (``dispatch``,
``lifecycle``, ``registry``, ``balancer``, ``decider``) and nothing there
imports it."""
