"""The multi-token prediction layer as the proposer (``speculative.mtp``), DeepSeek-V3's and GLM-4.5's:
its predictions against the layer computed from transformers' modules, exactness
against transformers' greedy tokens, the layer's KV through a handoff, and the
checkpoints it loads from."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitserve.engine.engine import Engine
from splitserve.engine.speculative.cost import StepCost
from splitserve.kv_transfer import get_backend
from splitserve.kv_transfer.backends.local import LocalHub
from splitserve.wire.config import EngineConfig, SpeculativeConfig
from splitserve.wire.errors import ModelLoadError
from splitserve.wire.sampling import SamplingParams
from tests.conftest import hf_greedy, make_hf_checkpoint, random_prompts
from tests.unit.kv_transfer.test_kv_transfer import compat, prefill

MAX_NEW = 20
PARAMS = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
MTP = SpeculativeConfig(method="mtp", num_tokens=1)


class MTPReference:
    """The MTP layer by its definition (``engine.model.mtp``'s diagram), on
    transformers' modules: the model's last hidden states, its embedding and LM head,
    and the layer as the model's own decoder layer (``DeepseekV3DecoderLayer``,
    ``Glm4MoeDecoderLayer``)."""

    def __init__(self, hf, layer, extra: dict[str, torch.Tensor]):
        self.hf, self.layer, self.extra = hf, layer, extra
        self.eps = hf.config.rms_norm_eps

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        x = x.float()
        return self.extra[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    @torch.no_grad()
    def predictions(self, tokens: list[int]) -> list[int]:
        """From each position q but the last: the predicted token at q + 2."""
        model = self.hf.model
        ids = torch.tensor([tokens])
        hidden = model(ids).last_hidden_state[0]  # after the final norm
        embedded = model.embed_tokens(ids)[0]
        x = torch.cat([self._norm(embedded[1:], "enorm"), self._norm(hidden[:-1], "hnorm")], dim=-1)
        x = F.linear(x, self.extra["eh_proj"])[None]
        positions = torch.arange(len(tokens) - 1)[None]
        mask = None  # causal, where the layer is given none
        if self.hf.config.model_type == "deepseek_v32":  # its indexer reads an explicit one
            n = len(tokens) - 1
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = self.layer(
            x, attention_mask=mask, position_ids=positions, position_embeddings=model.rotary_emb(x, positions)
        )
        out = out[0] if isinstance(out, tuple) else out
        return self.hf.lm_head(self._norm(out[0], "norm")).argmax(-1).tolist()


def _engine(directory, **overrides) -> Engine:
    cfg = dict(model=str(directory), dtype="float32", block_size=8, max_num_batched_tokens=64, max_num_seqs=8)
    return Engine(EngineConfig(**(cfg | overrides)))


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v32", "glm4_moe"])
def model(request, tmp_path_factory):
    """(checkpoint directory, transformers model, the MTP layer's reference): DeepSeek-V3,
    and GLM-4.5 (its MTP layer has V3's form, around GLM's own decoder layer)."""
    directory = tmp_path_factory.mktemp(f"{request.param}-mtp")
    hf = make_hf_checkpoint(request.param, directory, mtp=True)
    return directory, hf, MTPReference(hf, *hf.mtp_layer)


def _record_predictions(engine: Engine) -> list[tuple[str, int, int]]:
    """Every (request id, token, tokens before it) the engine's MTP layer predicts, step by step."""
    seen: list[tuple[str, int, int]] = []
    runner, run = engine.runner, engine.runner._predict_next

    def recording(*args, **kwargs):
        run(*args, **kwargs)
        seen.extend((rid, h.token, h.num_tokens) for rid, h in runner.mtp_heads.items())

    runner._predict_next = recording
    return seen


def _check_predictions(seen, sequences: dict[str, list[int]], reference: MTPReference) -> int:
    """How many predictions were checked; each equals the reference's at its position."""
    expected = {rid: reference.predictions(tokens) for rid, tokens in sequences.items()}
    for rid, token, n in seen:
        assert token == expected[rid][n - 2], (rid, n)
    return len(seen)


def test_the_mtp_layer_predicts_what_transformers_modules_compute(model, monkeypatch):
    """Each step's prediction of the token after next, for every decoding sequence,
    equals the MTP layer computed from transformers' own modules over the
    whole sequence (so the layer's KV of every earlier position, the prompt's
    included, is what it attends to); and greedy tokens stay transformers'."""
    monkeypatch.setattr(StepCost, "min_gain", property(lambda self: 0.0))  # propose every step
    directory, hf, reference = model
    prompts = random_prompts([5, 12, 31, 70], 512, seed=11)
    engine = _engine(directory, speculative=MTP)
    seen = _record_predictions(engine)
    out = engine.generate(prompts, PARAMS)
    assert [o.token_ids for o in out] == [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    sequences = {o.request_id: p + o.token_ids for p, o in zip(prompts, out)}
    assert _check_predictions(seen, sequences, reference) >= len(prompts) * (MAX_NEW - 2)
    counters = engine.stats().speculation
    # a step per token after the first two, less one for each draft kept (it made two)
    proposed = counters.proposed_tokens + counters.accepted_tokens
    assert counters.method == "mtp" and proposed >= len(prompts) * (MAX_NEW - 2), counters


def test_mtp_speculation_keeps_transformers_tokens_across_preemption(model):
    """A cache too small for every sequence at once: preempted sequences recompute
    (their MTP KV with them), and the tokens stay transformers'."""
    directory, hf, _ = model
    prompts = random_prompts([9, 40, 77, 20], 512, seed=12)
    engine = _engine(directory, speculative=MTP, num_kv_blocks=24, max_model_len=128)
    out = engine.generate(prompts, PARAMS)
    assert [o.token_ids for o in out] == [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    assert engine.stats().speculation.proposed_tokens > 0


def _handoff(prefilling: Engine, decode: Engine, prompts) -> dict[str, list[int]]:
    """Prefill ``prompts`` on ``prefilling``, hand each one's KV to ``decode`` through the
    local transfer backend; the prompt and first token of each, by request id."""
    hub, backend = LocalHub(), get_backend("local")
    source = backend.source(
        "prefill-0", prefilling.kv_cache.tensor, compat(prefilling), lease_s=30.0, hub=hub
    )
    sink = backend.sink("decode-0", decode.kv_cache.tensor, compat(decode), hub=hub)
    sink.connect(source.handshake())
    tokens = {}
    for p in prefill(prefilling, prompts, PARAMS):
        desc = source.export(p.request_id, p.block_ids, p.num_kv_tokens)
        blocks = decode.import_request(p.request_id, p.prompt_token_ids, p.output_token_ids, PARAMS)
        assert sink.pull(desc, blocks, timeout=30.0).delivered
        decode.activate(p.request_id)
        tokens[p.request_id] = p.prompt_token_ids + p.output_token_ids
    return tokens


def _decode(engine: Engine, tokens: dict[str, list[int]]) -> dict[str, list[int]]:
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id] = tokens[o.request_id] + o.new_token_ids
    return tokens


def test_the_prompts_mtp_kv_crosses_a_handoff_from_a_prefill_that_does_not_speculate(model, monkeypatch):
    """Prefill with the MTP layer run but no speculation, decode with MTP proposals:
    the prompt's MTP KV comes in the same transfer, so every decode-side prediction
    equals the reference over the whole sequence. Zeroing the MTP layer's blocks
    after the transfer (a handoff that left them behind) changes predictions: the
    check sees the prompt's MTP KV."""
    monkeypatch.setattr(StepCost, "min_gain", property(lambda self: 0.0))
    directory, hf, reference = model
    prompts = random_prompts([23, 50], 512, seed=13)
    expected = {tuple(p): p + hf_greedy(hf, p, MAX_NEW) for p in prompts}
    for leave_behind in (False, True):
        prefill = _engine(directory, mtp_layer=True)
        decode = _engine(directory, speculative=MTP)
        assert prefill.kv_cache.layout == decode.kv_cache.layout  # one layer more on both ends
        tokens = _handoff(prefill, decode, prompts)
        if leave_behind:
            decode.kv_cache.layer(decode.model_config.num_layers)[0].zero_()
        seen = _record_predictions(decode)
        done = _decode(decode, tokens)
        assert sorted(map(tuple, done.values())) == sorted(map(tuple, expected.values()))
        if not leave_behind:
            assert _check_predictions(seen, done, reference) >= len(prompts) * (MAX_NEW - 2)
            assert decode.stats().speculation.proposed_tokens > 0
        else:
            with pytest.raises(AssertionError):
                _check_predictions(seen, done, reference)


def test_a_checkpoint_with_an_mtp_layer_serves_without_it(model):
    """Released DeepSeek-V3 checkpoints ship the MTP layer; without speculation it is
    not read, and the KV cache has the decoder's layers only."""
    directory, hf, _ = model
    prompts = random_prompts([7, 19], 512, seed=14)
    engine = _engine(directory)
    assert engine.model.mtp is None
    assert engine.kv_cache.layout.num_layers == engine.model_config.num_layers
    out = engine.generate(prompts, PARAMS)
    assert [o.token_ids for o in out] == [hf_greedy(hf, p, MAX_NEW) for p in prompts]


def test_mtp_without_an_mtp_layer_fails_with_a_sentence(tmp_path):
    make_hf_checkpoint("deepseek_v3", tmp_path / "dsv3")  # the config says 1, the file has none
    with pytest.raises(ModelLoadError, match="no multi-token prediction layer"):
        _engine(tmp_path / "dsv3", speculative=MTP)
    make_hf_checkpoint("llama", tmp_path / "llama")
    with pytest.raises(ValueError, match="multi-token prediction layer"):
        _engine(tmp_path / "llama", speculative=MTP)
    with pytest.raises(ValueError, match="without tensor or expert parallelism"):
        EngineConfig(model="x", tp_size=2, mtp_layer=True)


def test_the_reference_is_causal(model):
    """The reference's predictions over a prefix are those over the whole sequence:
    what the engine's step-by-step predictions are compared with is well defined."""
    _, _, reference = model
    tokens = random_prompts([40], 512, seed=15)[0]
    assert reference.predictions(tokens[:25]) == reference.predictions(tokens)[:24]
