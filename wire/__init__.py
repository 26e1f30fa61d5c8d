"""splitserve.wire: the plain-data records that cross a process boundary.

Router, client, workers and the KV transfer layer exchange these (pickled over
Ray, or carried in a handoff); they import nothing but the standard library and
each other, so any process loads them without torch or Ray.

| module | records |
|---|---|
| ``sampling`` | ``SamplingParams``, ``FinishReason`` |
| ``errors`` | ``SplitserveError`` and every error a layer raises on purpose |
| ``outputs`` | what an engine hands back (``RequestOutput``, ``PrefilledRequest``, ``EngineStats``) |
| ``config`` | ``EngineConfig`` (in every worker spec) |
| ``defaults`` | ``GenerationDefaults``: a model's sampling defaults |
| ``validation`` | ``RequestValidator``: a request checked against a model's limits |
| ``prefix`` | prefix-cache block hashes and the log a router follows |
| ``tp`` | ``TPInit``: how a rank joins its tensor-parallel group |
| ``kv_layout`` | ``KVLayout``: one worker's KV cache shape |
| ``kv`` | the KV transfer contract (handshakes, descriptors, handoffs, confirmations) |
| ``prefill`` / ``decode`` | each worker kind's spec, tasks, results and stats |
"""
