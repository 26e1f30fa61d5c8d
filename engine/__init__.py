"""splitserve.engine: the inference engine every worker runs (no Ray, no gRPC).

``engine.Engine`` (one model, its KV cache, the scheduler and one step at a
time) and ``loop.EngineLoop`` (its thread, for asyncio callers). Its inputs and
outputs (``SamplingParams``, ``RequestOutput``, the errors, ``EngineConfig``)
are plain-data records in ``splitserve.wire``. The package itself imports
nothing, so importing one of its light modules (``tokenizer``) loads no torch.
"""
