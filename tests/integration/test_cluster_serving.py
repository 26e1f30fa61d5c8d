"""The disaggregated cluster's serving surface: bad input, backpressure,
health and reflection, conditional disaggregation, the OpenAI endpoint, the
bench load generator, decode admission order. Real Ray actors, the real gRPC
router and SDK over localhost, KV over NIXL, a tiny random-weight model.
(``test_cluster_backends`` runs the correctness core once per backend.)
One Ray instance and one cluster for the whole module."""

from __future__ import annotations

import threading

import openai
import pytest

from splitserve.client import (
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from splitserve.router.balancer import Prompt
from splitserve.router.decider import Placement
from splitserve.wire.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.integration.cluster_util import (
    VOCAB,
    live_cluster,
    mixed_workload,
    reference_tokens,
    scrape,
    stream_all,
    tiny_config,
    total,
    wait_kv_free,
    wait_until,
)


@pytest.fixture(scope="module")
def cluster(checkpoint):
    with live_cluster(tiny_config(checkpoint)) as c:
        yield c


def test_a_decode_worker_has_its_own_rates_before_its_first_request(cluster):
    """The decode worker measured its prompt rate and decode step time when it started,
    so the decider judges a prefill there by the decode worker's own speed, not the
    prefill pool's, and has a stall budget in its decode steps. (The module's first
    test: the decode worker has served no request yet.)"""
    decode = cluster.dispatcher.registry.get("decode-0")
    wait_until(
        lambda: decode.prefill_tokens_per_s > 0 and decode.decode_step_s > 0,
        "the decode worker reported no prompt rate or decode step time",
    )
    assert decode.stats.engine.decode_batch == 1  # the probe's, not a request's


BAD_INPUTS = [
    ({"prompt": []}, "empty"),
    ({"prompt": "hello"}, "tokenizer"),  # the tiny model has none: token ids only
    ({"prompt": list(range(2)) * 600}, "context"),
    ({"prompt": [1, 2, 3], "max_tokens": 0}, "max_tokens"),
    ({"prompt": [1, 2, 3], "max_tokens": 10**6}, "max_tokens"),
    ({"prompt": [1, 2, 3], "temperature": -1.0}, "temperature"),
    ({"prompt": [1, 2, 3], "top_p": 1.5}, "top_p"),
    ({"prompt": [1, VOCAB + 5]}, "token ids"),
    ({"prompt": None}, "no input"),
    ({"prompt": [1, 2, 3], "timeout_ms": 0, "request_id": "dup"}, None),  # valid, for contrast
]


def test_bad_input_is_refused_clearly_while_good_requests_complete(cluster, reference, client):
    prompts, params = mixed_workload(6, seed=11)
    expected = reference_tokens(reference, prompts, params)
    good: list = []
    t = threading.Thread(target=lambda: good.extend(stream_all(cluster.address, prompts, params)))
    t.start()
    for kwargs, needle in BAD_INPUTS:
        kwargs = dict(kwargs)
        prompt = kwargs.pop("prompt")
        if needle is None:
            assert client.generate(prompt, **kwargs).final is not None
            continue
        with pytest.raises(InvalidArgument) as e:
            client.generate(prompt, **kwargs)
        assert needle in e.value.details, e.value.details
    with pytest.raises(NotFound, match="unknown model 'gpt-5'; this server serves"):  # as vLLM: 404
        client.generate([1, 2, 3], model="gpt-5")
    t.join(120)
    assert [out.token_ids for out, _ in good] == expected
    assert wait_kv_free(client) == {"prefill-0": 0, "decode-0": 0}


def test_backpressure_past_the_inflight_limit(cluster, client):
    d = cluster.dispatcher
    original = d.limits
    cluster.run(_set(d, limits=original.model_copy(update={"max_inflight_requests": 2})))
    try:
        streams = [
            client.stream(
                random_prompts([20], VOCAB, seed=s)[0], temperature=0, max_tokens=900, ignore_eos=True
            )
            for s in (1, 2)
        ]
        for s in streams:
            next(s)  # both admitted and streaming
        with pytest.raises(ResourceExhausted, match="capacity"):
            client.generate([1, 2, 3], temperature=0, max_tokens=2)
        for s in streams:
            s.close()
    finally:
        cluster.run(_set(d, limits=original))
    assert wait_kv_free(client) == {"prefill-0": 0, "decode-0": 0}
    assert client.generate([1, 2, 3], temperature=0, max_tokens=2).final.completion_tokens == 2


async def _set(dispatcher, **fields):
    """Replace the dispatcher's limits or policy (on its loop, as every reader runs there)."""
    for name, value in fields.items():
        setattr(dispatcher, name, value)


def test_health_reflection_models_and_tokenize(cluster, client, checkpoint):
    import grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    assert client.health()
    with grpc.insecure_channel(cluster.address) as channel:
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert "splitserve.v1.Splitserve" in services and "grpc.health.v1.Health" in services
    (model,) = client.list_models()
    assert model.id == checkpoint.rsplit("/", 1)[-1] and model.vocab_size == VOCAB
    with pytest.raises(InvalidArgument, match="tokenizer"):
        client.tokenize("hello")


def test_conditional_disaggregation_prefills_short_prompts_on_the_decode_worker(cluster, reference, client):
    d = cluster.dispatcher
    original = d.policy
    cluster.run(_set(d, policy=original.model_copy(update={"local_prefill_below_tokens": 32})))
    try:
        short, long = random_prompts([10, 100], VOCAB, seed=5)
        params = SamplingParams(max_tokens=8)
        want = reference_tokens(reference, [short, long], [params, params])
        a = client.generate(short, temperature=0, max_tokens=8)
        b = client.generate(long, temperature=0, max_tokens=8)
    finally:
        cluster.run(_set(d, policy=original))
    assert (a.token_ids, b.token_ids) == (want[0], want[1])
    assert a.final.prefill_worker == "" and a.final.transfer_ms == 0
    assert b.final.prefill_worker == "prefill-0"


def test_the_decider_prefills_a_prefix_the_decode_worker_holds_there(cluster, reference, client):
    """With the decider on, a prompt whose prefix the decode worker already holds (it
    imported it for an earlier request) is prefilled on the decode worker from its
    cache; once the prefill worker is queued, prompts are prefilled where they finish
    sooner. Every output equals the monolithic engine's."""
    d = cluster.dispatcher
    original = d.policy
    policy = original.model_copy(
        update={"conditional_disaggregation": True, "local_prefill_max_stall_ms": 10_000}
    )
    params = SamplingParams(max_tokens=8)
    (stem,) = random_prompts([160], VOCAB, seed=41)
    first, second = stem + [7, 8, 9], stem + [10, 11, 12, 13]
    want = reference_tokens(reference, [first, second], [params, params])
    a = client.generate(first, temperature=0, max_tokens=8)  # the decider is still off: handed over
    assert a.final.prefill_worker == "prefill-0"
    decode = d.registry.get("decode-0")
    hashes = Prompt.of(second, decode.block_size).block_hashes
    wait_until(  # a poll brings the decode worker's cache and the measured rates
        lambda: (
            decode.cached_tokens(hashes, len(second)) >= 160
            and (decode.prefill_tokens_per_s or d.registry.get("prefill-0").prefill_tokens_per_s)
        ),
        "the router learned the decode worker's cache and rates",
        30,
        0.05,
    )
    counts = dict(d.decider.counts)
    cluster.run(_set(d, policy=policy))
    try:
        b = client.generate(second, temperature=0, max_tokens=8)
    finally:
        cluster.run(_set(d, policy=original))
    assert (a.token_ids, b.token_ids) == (want[0], want[1])
    assert b.final.prefill_worker == "" and b.final.transfer_ms == 0
    assert b.final.cached_prompt_tokens == 160
    (new_decision,) = [k for k, v in d.decider.counts.items() if v != counts.get(k, 0)]
    assert new_decision[0] == Placement.LOCAL
    shown = {(p.placement, p.reason): p.count for p in client.cluster_status().placements}
    assert shown[new_decision[0].value, new_decision[1].value] == d.decider.counts[new_decision]


def _check_logprobs(api, model: str, prompt: list[int], checkpoint: str) -> None:
    import openai

    """Completions' ``logprobs: 5`` with ``echo``: every prompt and output token's
    logprob and the top-5's at each position equal transformers' log_softmax of the
    float32 model within 1e-4, through the prefill worker (the prompt's) and the decode
    worker (the output's). The tiny model has no tokenizer: tokens are named ``token_id:ID``."""
    import torch
    from transformers import AutoModelForCausalLM

    out = api.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        logprobs=5,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    tokens = [int(t.removeprefix("token_id:")) for t in lp.tokens]
    assert tokens[: len(prompt)] == prompt and len(tokens) == len(prompt) + 6  # echo: the prompt first
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first token has no context
    assert out.choices[0].text == "".join(lp.tokens[: len(prompt)])  # (the output has no text here)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([tokens])).logits[0, :-1].float(), dim=-1)
    for i in range(1, len(tokens)):  # token i given tokens before it: the prompt's, then the output's
        assert abs(lp.token_logprobs[i] - ref[i - 1, tokens[i]].item()) < 1e-4, i
        best = ref[i - 1].topk(5)
        top = {int(k.removeprefix("token_id:")): v for k, v in lp.top_logprobs[i].items()}
        assert len(top) == 5, i
        if i >= len(prompt):
            assert tokens[i] == best.indices[0].item()  # greedy: the most likely
        for t, v in top.items():
            assert abs(v - ref[i - 1, t].item()) < 1e-4
        assert sorted(top.values(), reverse=True) == pytest.approx(best.values.tolist(), abs=1e-4)
    # vLLM's prompt_logprobs field: the same numbers, in its shape (token id -> logprob, rank)
    plain = api.completions.create(
        model=model, prompt=prompt, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 5}
    )
    by_position = plain.choices[0].to_dict()["prompt_logprobs"]
    assert len(by_position) == len(prompt) and by_position[0] is None
    for i in range(1, len(prompt)):
        entry = by_position[i]
        assert entry[str(prompt[i])]["logprob"] == pytest.approx(lp.token_logprobs[i], abs=1e-5)
        ranked = sorted((v for v in entry.values() if v["rank"] is not None), key=lambda v: v["rank"])
        assert [v["rank"] for v in ranked] == [1, 2, 3, 4, 5]
        expected = sorted(lp.top_logprobs[i].values(), reverse=True)
        assert [v["logprob"] for v in ranked] == pytest.approx(expected, abs=1e-5)
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        api.completions.create(model=model, prompt=prompt, stream=True, extra_body={"prompt_logprobs": 1})


def test_openai_http_endpoint_with_the_official_client(cluster, client, checkpoint):
    """The OpenAI-compatible endpoint, driven by the ``openai`` package itself."""
    api = openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused", max_retries=0)
    (model,) = api.models.list().data
    prompt = random_prompts([30], VOCAB, seed=12)[0]
    out = api.completions.create(
        model=model.id, prompt=prompt, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (30, 7)
    chunks = list(
        api.completions.create(
            model=model.id,
            prompt=prompt,
            max_tokens=7,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == 7
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    _check_logprobs(api, model.id, prompt, checkpoint)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        api.completions.create(model=model.id, prompt=prompt, max_tokens=5000)
    with pytest.raises(openai.NotFoundError, match="unknown model"):
        api.completions.create(model="gpt-5", prompt=prompt, max_tokens=5)
    with pytest.raises(openai.BadRequestError, match="`best_of`"):
        api.completions.create(model=model.id, prompt=prompt, max_tokens=5, best_of=2)
    assert wait_kv_free(client) == {"prefill-0": 0, "decode-0": 0}


def test_n_sequences_are_handed_over_once_and_each_equals_its_derived_seed(cluster, client):
    """``n=4`` with a seed: four distinct sequences, one KV handover for the request (the
    ``kv_handoffs`` metric), each equal to a request of its own seeded ``seed + i``; the
    three forks are prefilled on the decode worker from the prompt's blocks it imported
    (all but the last, partial one cached). The same through the OpenAI endpoint,
    streamed: four choices, each ending once, usage counting the prompt once."""
    (prompt,) = random_prompts([70], VOCAB, seed=21)
    options = dict(temperature=1.0, max_tokens=12, ignore_eos=True)

    def handoffs() -> float:
        return total(scrape(cluster), "splitserve:kv_handoffs_total")

    before = handoffs()
    outs = client.generate_n(prompt, n=4, seed=7, **options)
    wait_until(lambda: handoffs() > before, "the request's handover was not counted")
    assert handoffs() - before == 1
    assert [o.index for o in outs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in outs}) == 4
    assert outs[0].final.prefill_worker == "prefill-0"
    block = cluster.dispatcher.registry.get("decode-0").block_size
    for fork in outs[1:]:
        assert fork.final.prefill_worker == "" and fork.final.decode_worker == "decode-0"
        assert fork.final.cached_prompt_tokens == len(prompt) // block * block
    alone = [client.generate(prompt, seed=7 + i, **options).token_ids for i in range(4)]
    assert [o.token_ids for o in outs] == alone

    api = openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused", max_retries=0)
    chunks = list(
        api.completions.create(
            model="",
            prompt=prompt,
            n=4,
            seed=7,
            max_tokens=12,
            temperature=1.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    ended = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(ended) == [0, 1, 2, 3]
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (70, 48)
    # echo with logprobs: every choice shows the prompt's (scored once, by the first sequence)
    both = api.completions.create(
        model="", prompt=prompt, n=2, seed=7, max_tokens=3, temperature=1.0, echo=True, logprobs=2
    )
    first, second = (c.logprobs.token_logprobs[:70] for c in both.choices)
    assert first == second and first[0] is None and None not in first[1:]
    assert wait_kv_free(client) == {"prefill-0": 0, "decode-0": 0}


def test_bench_load_generator_against_the_live_cluster(cluster, client):
    """``splitserve bench serve``'s load generator: every request completes with the
    asked output length, and the metrics see every token."""
    import asyncio

    from splitserve.loadgen import workloads
    from splitserve.loadgen.metrics import compute_metrics
    from splitserve.loadgen.serve import run_load

    reqs = workloads.random_requests(8, 40, 12, vocab_size=VOCAB, seed=3, range_ratio=0.5)
    arrivals = workloads.arrival_times(len(reqs), rate=20.0, seed=3)
    records, duration = asyncio.run(
        run_load(cluster.address, reqs, arrivals, max_concurrency=4, progress=False)
    )
    assert all(r.success for r in records)
    assert [r.output_len for r in records] == [q.output_len for q in reqs]
    assert [r.prompt_len for r in records] == [len(q.prompt_ids) for q in reqs]
    m = compute_metrics(records, duration, {"tpot": 10_000})
    assert m["completed"] == 8 and m["total_output_tokens"] == sum(q.output_len for q in reqs)
    assert m["slo_attainment"] == 1.0 and 0 < m["mean_ttft_ms"] <= m["mean_e2el_ms"]
    assert wait_kv_free(client) == {"prefill-0": 0, "decode-0": 0}


def test_bench_multi_turn_conversations_resend_what_the_server_answered(cluster, client):
    """``--dataset multi-turn``: each turn's prompt is the conversation so far with the
    server's own answers, so a turn's prompt is the previous one's plus its answer and a
    new message; the decode worker already holds those earlier turns' blocks (as the
    bench's own reading of the server's counters shows)."""
    import asyncio

    from splitserve.loadgen import workloads
    from splitserve.loadgen.serve import run_conversations, server_counters

    def counters() -> dict[str, float]:
        return asyncio.run(server_counters(cluster.address))

    before = counters()
    convs = workloads.multi_turn(3, 3, 48, 12, 8, vocab_size=VOCAB, seed=4, think_s=0.0)
    arrivals = workloads.arrival_times(3, rate=20.0, seed=4)
    records, _ = asyncio.run(run_conversations(cluster.address, convs, arrivals, progress=False))
    assert len(records) == 9 and all(r.success and r.output_len == 8 for r in records)
    by_len = sorted(r.prompt_len for r in records)
    expected = sorted(48 + sum(len(u) for u in c.user_ids[: t + 1]) + 8 * t for c in convs for t in range(3))
    assert by_len == expected
    after = counters()
    assert after["prefilled_remote"] - before["prefilled_remote"] == 9  # the decider is off here
    assert after["held_tokens"] > before["held_tokens"]  # later turns found their history there
    assert wait_kv_free(client) == {"prefill-0": 0, "decode-0": 0}
