"""Multi-LoRA through the cluster: real Ray actors (a prefill worker and a TP=2
decode group of the tiny model, each rank with its share of two PEFT adapters),
NIXL, the router's gRPC door and its OpenAI door. A request names an adapter as
its model; its prompt is prefilled under that adapter, the KV handed over (each
decode rank pulling its KV head) and decoded under it: the client's greedy tokens
equal transformers + PEFT (the adapter merged), and the KV was pulled (no transfer
failed). An unknown model name is refused naming it; ``/v1/models`` lists the
adapters with their parent."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from transformers import AutoConfig

from splitserve.cli.main import main
from splitserve.client import Client
from splitserve.client.errors import NotFound
from splitserve.engine.lora import load_adapter
from tests.conftest import random_prompts
from tests.integration.cluster_util import (
    VOCAB,
    assert_kv_moved,
    live_cluster,
    post_json,
    scrape,
    tiny_config,
    total,
    wait_until,
)
from tests.lora_util import make_adapter, merged_greedy

pytest.importorskip("peft")

MAX_NEW = 12
ADAPTERS = {
    "a1": (4, 8, ["q_proj", "v_proj", "down_proj"], False),
    "a2": (8, 4, ["k_proj", "o_proj", "up_proj"], True),
}


@pytest.fixture(scope="module")
def served(checkpoint, tmp_path_factory):
    dirs = {}
    for i, (name, spec) in enumerate(ADAPTERS.items()):
        dirs[name] = tmp_path_factory.mktemp(f"lora-{name}")
        make_adapter(checkpoint, dirs[name], *spec, seed=20 + i)
    prompts = random_prompts([9, 30, 21], VOCAB, seed=8)
    expected = {None: merged_greedy(checkpoint, None, prompts, MAX_NEW)}
    expected.update({n: merged_greedy(checkpoint, d, prompts, MAX_NEW) for n, d in dirs.items()})
    lora = {"enable_lora": True, "lora_modules": {n: str(d) for n, d in dirs.items()}, "max_lora_rank": 8}
    lora["max_loras"] = 2  # an adapter loaded at run time takes turns with these two
    model = {"name": checkpoint, "dtype": "float32", "served_name": "tiny", **lora}
    engine = {"kv_cache_memory_mib": 16, "max_num_batched_tokens": 256}
    decode = {"num_cpus": 0.5, "tp_size": 2, "engine": engine}  # each rank its share of each adapter
    config = tiny_config(checkpoint, model=model, prefill={"num_cpus": 0.5, "engine": engine}, decode=decode)
    with live_cluster(config) as c:
        yield c, prompts, expected


def test_each_request_runs_under_the_adapter_it_names_through_the_handoff(served):
    cluster, prompts, expected = served
    for name in ADAPTERS:
        assert expected[name] != expected[None], name  # a base forward would fail below
    with Client(cluster.address, timeout=120) as client:
        finals = []
        for i, prompt in enumerate(prompts):
            for model in ("tiny", "a1", "a2"):
                out = client.generate(
                    prompt, model=model, max_tokens=MAX_NEW, ignore_eos=True, temperature=0.0
                )
                want = expected[None if model == "tiny" else model][i]
                assert out.token_ids == want, (i, model)
                finals.append(out.final)
        assert_kv_moved(finals, client)
        sent = {name: [0, 0] for name in ADAPTERS}  # requests, tokens: as the client saw them
        for f, model in zip(finals, ["tiny", "a1", "a2"] * len(prompts)):
            if model in sent:
                sent[model][0] += 1
                sent[model][1] += f.completion_tokens

        def counted() -> bool:
            values = scrape(cluster)
            series = ("splitserve:lora_requests_total", "splitserve:lora_generation_tokens_total")
            return all([total(values, m, adapter=a) for m in series] == want for a, want in sent.items())

        wait_until(counted, "each adapter's requests and tokens in /metrics")
        assert [m.id for m in client.list_models()] == ["tiny", "a1", "a2"]
        with pytest.raises(NotFound, match="unknown model 'a3'"):
            client.generate(prompts[0], model="a3", max_tokens=2)


def test_status_lists_each_workers_adapters(served, capsys):
    """Every worker (the prefill worker, the decode group) lists both adapters, each with
    the digest of the files it loaded; ``splitserve status`` prints them."""
    cluster, _, _ = served
    layers = AutoConfig.from_pretrained(cluster.cluster.config.model.name).num_hidden_layers
    files = cluster.cluster.config.model.lora_modules
    want = {n: load_adapter(n, path, layers, max_rank=8).digest for n, path in files.items()}
    with Client(cluster.address, timeout=60) as client:
        workers = [w for p in client.cluster_status().pools for w in p.workers]
    assert sorted(w.role for w in workers) == ["decode", "prefill"]
    assert all(dict(w.lora_adapters) == want for w in workers), [dict(w.lora_adapters) for w in workers]
    assert main(["status", "--server", cluster.address]) == 0
    printed = capsys.readouterr().out
    for w in workers:
        assert f"LoRA adapters on {w.worker_id}: a1 ({want['a1']}), a2 ({want['a2']})" in printed


def test_the_openai_door_lists_the_adapters_and_serves_them(served):
    """(The tiny model has no tokenizer, so no text to compare: the tokens under each
    adapter are the gRPC test's; the model name takes the same path here.)"""
    cluster, prompts, _ = served
    base = f"http://{cluster.http_address}/v1"
    with urllib.request.urlopen(f"{base}/models", timeout=60) as r:
        models = json.load(r)["data"]
    assert [(m["id"], m.get("parent")) for m in models] == [("tiny", None), ("a1", "tiny"), ("a2", "tiny")]
    body = {"model": "a2", "prompt": prompts[1], "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(
        f"{base}/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        answer = json.load(r)
    assert answer["usage"]["completion_tokens"] == MAX_NEW and answer["model"] == "a2"  # as vLLM echoes it
    body["model"] = "a3"
    req = urllib.request.Request(
        f"{base}/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=120)
    assert e.value.code == 404 and "unknown model 'a3'" in e.value.read().decode()


def test_an_adapter_loaded_at_run_time_serves_the_next_request_on_every_worker(served, tmp_path):
    """vLLM's ``/v1/load_lora_adapter`` on a running cluster: the prefill worker and both
    ranks of the decode group load it (each rank its share), and the next requests run
    under it through the handoff, as transformers + PEFT, in a slot a1 or a2 held (two
    slots, three adapters: written on both decode ranks as the request needs it), and
    requests under a1 and a2 after them still as theirs; a bad load changes nothing;
    unloaded, it is NOT_FOUND and gone from every worker; loaded again under the same
    name with other weights, the requests get the new weights (no KV of the old)."""
    cluster, prompts, expected = served
    checkpoint = cluster.cluster.config.model.name
    d = tmp_path / "a3"
    make_adapter(checkpoint, d, 8, 16, ["q_proj", "k_proj", "gate_proj", "down_proj"], False, seed=40)
    want = merged_greedy(checkpoint, d, prompts, MAX_NEW)
    assert want != expected[None]
    base = f"http://{cluster.http_address}/v1"
    layers = AutoConfig.from_pretrained(checkpoint).num_hidden_layers

    def adapters_everywhere() -> list[dict[str, str]]:
        with Client(cluster.address, timeout=60) as client:
            return [dict(w.lora_adapters) for p in client.cluster_status().pools for w in p.workers]

    assert post_json(f"{base}/load_lora_adapter", {"lora_name": "a3", "lora_path": str(d)}) == (
        200,
        "Success: LoRA adapter 'a3' added successfully.",
    )
    digest = load_adapter("a3", d, layers, max_rank=8).digest
    with Client(cluster.address, timeout=120) as client:
        finals = []
        for i, prompt in enumerate(prompts):  # one prefill worker, one decode group: both ran it
            out = client.generate(prompt, model="a3", max_tokens=MAX_NEW, ignore_eos=True, temperature=0.0)
            assert out.token_ids == want[i], i
            finals.append(out.final)
        for i, prompt in enumerate(prompts):  # the slots taken back
            for name in ("a1", "a2"):
                out = client.generate(
                    prompt, model=name, max_tokens=MAX_NEW, ignore_eos=True, temperature=0.0
                )
                assert out.token_ids == expected[name][i], (i, name)
                finals.append(out.final)
        assert_kv_moved(finals, client)
        assert [m.id for m in client.list_models()] == ["tiny", "a1", "a2", "a3"]
    wait_until(lambda: all(a.get("a3") == digest for a in adapters_everywhere()), "a3 listed on every worker")

    status, text = post_json(f"{base}/load_lora_adapter", {"lora_name": "a3", "lora_path": str(d)})
    assert status == 400 and "served already" in text
    status, text = post_json(
        f"{base}/load_lora_adapter", {"lora_name": "a4", "lora_path": str(tmp_path / "none")}
    )
    assert status == 400 and "could not load it" in text and "adapter_config.json is missing" in text
    with Client(cluster.address, timeout=60) as client:
        assert "a4" not in [m.id for m in client.list_models()]
        assert all("a4" not in a for a in adapters_everywhere())

        assert post_json(f"{base}/unload_lora_adapter", {"lora_name": "a3"}) == (
            200,
            "Success: LoRA adapter 'a3' removed successfully.",
        )
        with pytest.raises(NotFound, match="unknown model 'a3'"):
            client.generate(prompts[0], model="a3", max_tokens=2)
        wait_until(lambda: all("a3" not in a for a in adapters_everywhere()), "a3 gone from every worker")
        assert post_json(f"{base}/unload_lora_adapter", {"lora_name": "a3"})[0] == 404

        a1_dir = cluster.cluster.config.model.lora_modules["a1"]
        assert post_json(f"{base}/load_lora_adapter", {"lora_name": "a3", "lora_path": a1_dir})[0] == 200
        out = client.generate(prompts[2], model="a3", max_tokens=MAX_NEW, ignore_eos=True, temperature=0.0)
        assert out.token_ids == expected["a1"][2]
        assert post_json(f"{base}/unload_lora_adapter", {"lora_name": "a3"})[0] == 200
