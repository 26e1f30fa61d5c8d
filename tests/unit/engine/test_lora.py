"""Multi-LoRA in the engine (``engine.lora``): one batch mixes requests of the base
model and of several PEFT adapters (different ranks, targets, rsLoRA); each request's
float32 greedy tokens equal transformers + PEFT's (the adapter merged) token for
token, with chunked prefill and prefix caching. The prefix cache never serves one
adapter's KV to another or to the base. Adapters this engine cannot run are refused
at load with a sentence naming the file; a request naming no loaded adapter is refused."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from splitserve.engine.engine import Engine
from splitserve.engine.lora import LoRAAdapters, load_adapter
from splitserve.wire.config import EngineConfig, SpeculativeConfig
from splitserve.wire.errors import AdapterMismatch, InvalidRequest, ModelLoadError
from splitserve.wire.sampling import SamplingParams
from tests.conftest import make_hf_checkpoint, random_prompts
from tests.lora_util import make_adapter, merged_greedy

peft = pytest.importorskip("peft")

MAX_NEW = 16
LENGTHS = [5, 19, 40, 3, 33, 11]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
# name -> (rank, alpha, targets, rsLoRA)
ADAPTERS = {
    "a1": (4, 8, ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"], False),
    "a2": (8, 4, [*ATTENTION, "gate_proj", "up_proj", "down_proj"], True),
}
MOE_ADAPTERS = {"a1": (4, 8, ["q_proj", "v_proj"], False), "a2": (8, 4, ATTENTION, True)}


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3_moe"])
def served(request, tmp_path_factory):
    """(checkpoint, {adapter: directory}, prompts, {adapter or None: expected tokens})."""
    kind = request.param
    checkpoint = tmp_path_factory.mktemp(kind)
    make_hf_checkpoint(kind, checkpoint)
    specs = MOE_ADAPTERS if kind == "qwen3_moe" else ADAPTERS
    dirs = {}
    for i, (name, spec) in enumerate(specs.items()):
        dirs[name] = tmp_path_factory.mktemp(f"{kind}-{name}")
        make_adapter(checkpoint, dirs[name], *spec, seed=10 + i)
    prompts = random_prompts(LENGTHS, 128, seed=5)
    expected = {None: merged_greedy(checkpoint, None, prompts, MAX_NEW)}
    expected.update({name: merged_greedy(checkpoint, d, prompts, MAX_NEW) for name, d in dirs.items()})
    return checkpoint, dirs, prompts, expected


def make_engine(checkpoint, dirs, **overrides) -> Engine:
    cfg = dict(
        model=str(checkpoint),
        dtype="float32",
        block_size=8,
        max_num_batched_tokens=32,  # the longer prompts are chunked
        kv_cache_memory_mib=16,
        enable_lora=True,
        lora_modules={name: str(d) for name, d in dirs.items()},
        max_lora_rank=8,
    )
    cfg.update(overrides)
    return Engine(EngineConfig(**cfg))


def params(adapter: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, adapter=adapter)


# LoRAAdapters.MIN_RUN_ROWS: every adapter row in a run of its own (decode rows too);
# chunks of 4+ rows as runs, the rest one-hot (a step holds both); every row one-hot
RUN_ROWS = [1, 4, 10**9]


@pytest.mark.parametrize("run_rows", RUN_ROWS, ids=["runs", "both", "one-hot"])
def test_one_batch_mixes_adapters_and_the_base_each_as_transformers_and_peft(served, run_rows, monkeypatch):
    monkeypatch.setattr(LoRAAdapters, "MIN_RUN_ROWS", run_rows)
    checkpoint, dirs, prompts, expected = served
    for name in dirs:  # each adapter changes the tokens: a base forward would fail here
        assert expected[name] != expected[None], name
    engine = make_engine(checkpoint, dirs)
    names = [None, *dirs]
    which = [names[i % len(names)] for i in range(len(prompts))] + [names[(i + 1) % 3] for i in range(3)]
    batch = prompts + prompts[:3]
    outs = engine.generate(batch, [params(n) for n in which])
    for i, (out, name) in enumerate(zip(outs, which)):
        assert out.token_ids == expected[name][i % len(prompts)], (i, name)


def test_decode_steps_replayed_from_cuda_graphs_run_each_row_under_its_adapter(served, monkeypatch):
    """``cuda_graphs``: a pure-decode step of base and adapter rows replays a recording
    whose adapters' pass reads the rows' slots from a static buffer (off CUDA the
    recording re-runs over the same buffers: the filling and padding are the same);
    prefill steps run eagerly, as runs and one-hot. Tokens as transformers + PEFT."""
    checkpoint, dirs, prompts, expected = served
    graphed = dict(attention_backend="triton", cuda_graphs=True, num_kv_blocks=64, max_num_seqs=8)
    try:
        engine = make_engine(checkpoint, dirs, max_model_len=256, **graphed)
    except ValueError as e:  # a MoE model: no graphs, adapters or not
        assert "does not run with cuda_graphs" in str(e)
        pytest.skip(str(e))
    graphs = engine.runner.graphs
    replayed = []
    run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda ids, *rest: replayed.append(len(ids)) or run(ids, *rest))
    names = [None, *dirs]
    which = [names[i % len(names)] for i in range(len(prompts))]
    outs = engine.generate(prompts, [params(n) for n in which])
    for i, (out, name) in enumerate(zip(outs, which)):
        assert out.token_ids == expected[name][i], (i, name)
    assert max(replayed) == len(prompts)  # decode steps of the whole batch were replayed


def test_a_self_speculation_draft_proposes_under_each_request_s_adapter(served, monkeypatch):
    """The draft runs the target's first layers: under a request's adapter, its first
    proposed token is the greedy token of transformers' model cut to those layers (its
    final norm and LM head after them) with the adapter merged."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    checkpoint, dirs, prompts, expected = served
    spec = SpeculativeConfig(method="self", num_tokens=2, draft_layers=1, adaptive=False)
    engine = make_engine(checkpoint, dirs, speculative=spec)
    proposer = engine.speculation.proposer
    seen = []  # (request id, its tokens, the draft's first token)
    propose = proposer.propose

    def spy(requests):
        drafts = propose(requests)
        seen.extend((r.request_id, list(r.token_ids), d[0]) for r, d in zip(requests, drafts) if d)
        return drafts

    monkeypatch.setattr(proposer, "propose", spy)
    names = [None, *dirs]
    which = {f"r{i}": names[i % len(names)] for i in range(len(prompts))}
    for i, rid in enumerate(which):
        engine.add_request(prompts[i], params(which[rid]), rid)
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
    for i, (rid, name) in enumerate(which.items()):
        assert outs[rid] == expected[name][i], (rid, name)  # verified: the target's tokens
    assert engine.speculation.counters().proposer_errors == 0

    def cut(name):  # transformers' model, the adapter merged, its first layer only
        model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
        if name is not None:
            model = PeftModel.from_pretrained(model, str(dirs[name])).merge_and_unload()
        model.model.layers = model.model.layers[:1]
        model.config.num_hidden_layers = 1
        return model

    references = {name: cut(name) for name in names}
    assert {which[rid] for rid, _, _ in seen} == set(names)  # every adapter's requests were drafted
    with torch.no_grad():
        for rid, tokens, first in seen:
            logits = references[which[rid]](torch.tensor([tokens])).logits[0, -1]
            assert first == int(logits.argmax()), (rid, which[rid], len(tokens))


def test_the_prefix_cache_serves_a_prompt_only_under_the_adapter_that_computed_it(served):
    checkpoint, dirs, prompts, expected = served
    engine = make_engine(checkpoint, dirs, enable_prefix_caching=True)
    prompt = prompts[2]  # 40 tokens: 4 full blocks to reuse
    (first,) = engine.generate([prompt], params("a1"))
    (other,) = engine.generate([prompt], params("a2"))
    (base,) = engine.generate([prompt], params(None))
    (again,) = engine.generate([prompt], params("a1"))
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    assert again.num_cached_tokens > 0
    assert first.token_ids == again.token_ids == expected["a1"][2]
    assert other.token_ids == expected["a2"][2] and base.token_ids == expected[None][2]


def test_a_request_naming_no_loaded_adapter_is_refused_and_the_engine_serves_on(served):
    checkpoint, dirs, prompts, expected = served
    engine = make_engine(checkpoint, dirs)
    with pytest.raises(InvalidRequest, match="no LoRA adapter named 'nope'"):
        engine.add_request(prompts[0], params("nope"))
    plain = make_engine(checkpoint, {}, enable_lora=False)
    with pytest.raises(InvalidRequest, match="LoRA adapters are not enabled"):
        plain.add_request(prompts[0], params("a1"))
    (out,) = engine.generate([prompts[1]], params("a1"))
    assert out.token_ids == expected["a1"][1]


def _rewrite_config(directory, **changes) -> None:
    path = directory / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def test_an_adapter_the_engine_cannot_run_is_refused_at_load_naming_its_file(served, tmp_path):
    checkpoint, dirs, _, _ = served
    some = next(iter(dirs.values()))
    with pytest.raises(ModelLoadError, match="rank 8, above max_lora_rank 4"):
        make_engine(checkpoint, {"a2": dirs["a2"]}, max_lora_rank=4)
    with pytest.raises(ModelLoadError, match="adapter_config.json is missing"):
        make_engine(checkpoint, {"empty": tmp_path})
    dora = tmp_path / "dora"
    dora.mkdir()
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        (dora / f).write_bytes((some / f).read_bytes())
    _rewrite_config(dora, use_dora=True)
    with pytest.raises(ModelLoadError, match=r"adapter_config.json uses DoRA"):
        make_engine(checkpoint, {"dora": dora})
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be at least max_loras \(2\)"):
        make_engine(checkpoint, dirs, max_loras=2, max_cpu_loras=1)
    wrong = tmp_path / "wrong"  # an adapter of another model: one B a row short
    wrong.mkdir()
    (wrong / "adapter_config.json").write_bytes((some / "adapter_config.json").read_bytes())
    tensors = load_file(str(some / "adapter_model.safetensors"))
    key = next(k for k in tensors if k.endswith("lora_B.weight"))
    tensors[key] = tensors[key][:-1].contiguous()
    save_file(tensors, str(wrong / "adapter_model.safetensors"))
    refusal = r"\(.*wrong\): layer \d+'s .*(do not fit|B has \d+ rows; the model's has)"
    with pytest.raises(ModelLoadError, match=refusal):
        make_engine(checkpoint, {"wrong": wrong})


def test_an_adapter_loaded_at_run_time_serves_and_unloads_without_touching_running_requests(served):
    """An engine started with no adapter loads one and serves it as one loaded at start
    would; unloaded, it serves no new request while the one running under it finishes
    under it, in its slot; other weights under that name wait until it has (a request's
    weights never change mid-way), and then get none of the old weights' cached KV."""
    checkpoint, dirs, prompts, expected = served
    first, second = dirs.values()
    engine = make_engine(checkpoint, {}, max_loras=2, enable_prefix_caching=True)
    digest = engine.load_adapter("a1", str(first))
    assert digest == load_adapter("a1", first, 64, 8).digest
    assert dict(engine.stats().lora_adapters) == {"a1": digest}
    (out,) = engine.generate([prompts[2]], params("a1"))
    assert out.token_ids == expected["a1"][2]
    assert engine.load_adapter("a1", str(first)) == digest  # the same weights: nothing changes
    with pytest.raises(ModelLoadError, match="'a1' is loaded already, with other weights"):
        engine.load_adapter("a1", str(second))
    engine.add_request(prompts[2], params("a1"), "old")  # runs under the first weights
    tokens = [t for o in engine.step() for t in o.new_token_ids]
    engine.unload_adapter("a1")
    assert engine.stats().lora_adapters == ()
    with pytest.raises(InvalidRequest, match="no LoRA adapter named 'a1'"):
        engine.add_request(prompts[0], params("a1"))
    with pytest.raises(ModelLoadError, match="requests still run here under its earlier weights"):
        engine.load_adapter("a1", str(second))
    other = engine.load_adapter("a2", str(second))  # slot 0 still runs "old": slot 1
    engine.add_request(prompts[2], params("a2"), "new")
    got: dict[str, list[int]] = {"old": tokens, "new": []}
    cached = set()
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
            if o.request_id == "new":
                cached.add(o.num_cached_tokens)
    assert got["old"] == expected["a1"][2]  # the first weights to the end
    assert got["new"] == expected["a2"][2] and cached == {0}
    assert engine.load_adapter("a1", str(second)) == other  # "old" ended: its slot is free
    (out,) = engine.generate([prompts[2]], params("a1"))
    assert out.token_ids == expected["a2"][2]  # none of the first weights' cached KV
    with pytest.raises(InvalidRequest, match="no LoRA adapter named 'a9'"):
        engine.unload_adapter("a9")


def test_more_adapters_than_slots_take_turns_and_the_base_never_waits(served):
    """One slot and one host copy, three adapters: each request waits for the slot until
    no request runs in it (then it is written: from the host copy, or read again), the
    base model's requests run meanwhile, and every request's tokens are as if each
    adapter had a slot of its own."""
    checkpoint, dirs, prompts, expected = served
    first, second = dirs.values()
    engine = make_engine(checkpoint, {"a1": first, "a2": second}, max_loras=1, max_cpu_loras=1)
    engine.load_adapter("a3", str(first))  # more adapters than slots: served, in no slot yet
    names = ["a1", None, "a2", "a3", None, "a2"]
    want = {"a1": expected["a1"], "a3": expected["a1"], "a2": expected["a2"], None: expected[None]}
    ids = [engine.add_request(prompts[i], params(n)) for i, n in enumerate(names)]
    got: dict[str, list[int]] = {rid: [] for rid in ids}
    adapters_per_step, first_token = [], {}
    while engine.has_unfinished():
        outs = engine.step()
        running = {s.params.adapter for s in engine.scheduler.running} - {None}
        adapters_per_step.append(running)
        for o in outs:
            got[o.request_id] += o.new_token_ids
            first_token.setdefault(o.request_id, len(adapters_per_step)) if o.new_token_ids else None
    assert all(len(a) <= 1 for a in adapters_per_step)  # never two adapters in one step
    assert first_token[ids[4]] < first_token[ids[2]]  # the base, added later, went past the waiting a2
    for i, (rid, name) in enumerate(zip(ids, names)):
        assert got[rid] == want[name][i], (i, name)
    assert len(got[ids[1]]) == MAX_NEW


def test_kv_computed_under_another_adapter_is_refused_at_activation(served):
    """Workers whose adapters differ still share a KV layout (the adapters are not part
    of the revision); a request's KV names the adapter it was computed under, and an
    engine where that name holds other weights refuses it (nothing activated)."""
    checkpoint, dirs, prompts, expected = served
    (name, first), (_, second) = list(dirs.items())[:2]
    source = make_engine(checkpoint, {name: first})
    alike, other = make_engine(checkpoint, {name: first}), make_engine(checkpoint, {name: second})
    assert source.kv_compat().hash == other.kv_compat().hash == make_engine(checkpoint, {}).kv_compat().hash
    source.add_request(prompts[4], params(name), "r", prefill_only=True)
    while source.has_unfinished():
        source.step()
    kv = source.prefilled("r")
    assert kv.adapter_digest == source.adapter_digest("r") == load_adapter(name, first, 64, 8).digest
    data = source.kv_cache.read_blocks(kv.block_ids)
    for sink in (other, alike):
        ids = sink.import_request("r", prompts[4], kv.output_token_ids, params(name))
        sink.kv_cache.write_blocks(ids, data)
    with pytest.raises(
        AdapterMismatch, match=f"computed under LoRA adapter '{name}' with weights {kv.adapter_digest}"
    ):
        other.activate("r", adapter_digest=kv.adapter_digest)
    with pytest.raises(AdapterMismatch, match="computed under the base model"):
        other.activate("r", adapter_digest="")
    assert other.abort("r") and other.block_manager.num_used_blocks == 0
    alike.activate("r", adapter_digest=kv.adapter_digest)
    tokens = list(kv.output_token_ids)
    while alike.has_unfinished():
        tokens += [t for o in alike.step() for t in o.new_token_ids]
    assert tokens == expected[name][4]


def test_an_adapter_whose_files_changed_fails_its_request_alone(served, tmp_path):
    """A slot is written from the host copy, or read again from the adapter's path (past
    ``max_cpu_loras``): files changed there since the load fail the request that needed
    them, alone; the engine and the others go on."""
    checkpoint, dirs, prompts, expected = served
    first, second = dirs.values()
    moved = tmp_path / "a1"
    shutil.copytree(first, moved)
    engine = make_engine(checkpoint, {"a1": moved, "a2": second}, max_loras=1, max_cpu_loras=1)
    digest = engine.loras.served["a1"]
    for f in ("adapter_config.json", "adapter_model.safetensors"):  # a1's host copy is gone: a2's is kept
        shutil.copy(second / f, moved / f)
    with pytest.raises(ModelLoadError, match="changed since it was loaded"):  # a TP rank's write, reading
        engine.loras.write("a1", moved, 0, digest=digest)
    bad, base = engine.generate([prompts[0], prompts[1]], [params("a1"), params(None)])
    assert bad.error is not None and bad.error.kind == "lora"
    assert "changed since it was loaded" in str(bad.error) and bad.token_ids == []
    assert base.error is None and base.token_ids == expected[None][1]
    (good,) = engine.generate([prompts[2]], params("a2"))
    assert good.token_ids == expected["a2"][2]
    (moved / "adapter_config.json").write_text("{")  # files that no longer parse: the same
    (broken,) = engine.generate([prompts[0]], params("a1"))
    assert broken.error is not None and broken.error.kind == "lora" and "JSONDecodeError" in str(broken.error)
    (good,) = engine.generate([prompts[2]], params("a2"))
    assert good.token_ids == expected["a2"][2]


def test_a_request_waiting_for_a_slot_is_not_overtaken_by_later_ones_under_the_adapter_in_it(served):
    """One slot, held by a1's request: a2's request waits for it, and a1's requests that
    come after a2's wait behind it (joining the held slot would keep it held for as long
    as they keep coming: a2 would starve)."""
    checkpoint, dirs, prompts, expected = served
    engine = make_engine(checkpoint, dirs, max_loras=1)
    engine.add_request(prompts[0], params("a1"), "first")
    engine.step()
    engine.add_request(prompts[1], params("a2"), "waiting")
    engine.step()
    engine.add_request(prompts[3], params("a1"), "later")
    first_token, got = {}, {"first": [], "waiting": [], "later": []}
    step = 0
    while engine.has_unfinished():
        step += 1
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
            if o.new_token_ids:
                first_token.setdefault(o.request_id, step)
    assert first_token["waiting"] < first_token["later"]
    assert got["waiting"] == expected["a2"][1] and got["later"] == expected["a1"][3]
