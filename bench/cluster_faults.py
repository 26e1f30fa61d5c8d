"""Handoff faults through the cluster (issue 68): one fault at a time injected into an
otherwise correct handoff between a prefill worker and a decode worker (Ray actors,
KV over NIXL, the router in front), each request checked against the monolithic
engine's greedy tokens.

A worker arms a fault for a request id the harness then sends (``arm_fault``,
``wire.faults``); each fault strikes once, where such a bug would. Each row: which
check caught it (the router counts a failed transfer by its error:
``IntegrityError``: the checksums, ``LeaseExpired``: the lease, ``MeaningMismatch``:
the meaning check), the client's tokens equal the engine's or not, the KV blocks
still held on any worker once the cluster is idle, the time from the first token
(the source's KV ready) to the router's ``kv_recompute`` mark, and that mark's
sentence (it names the worker pair and the error).

Exports go whole (``transfer.stream_layers: false``), so that a source fault lands
after the hashes and before the pull; leases last ``LEASE_S`` so that a pull past
its lease comes soon. ``bench.handoff_faults`` runs these setups; the CI-size test
(``tests/integration/test_handoff_faults.py``) runs a subset on the suite's Ray.
"""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import ray

from splitserve.cluster.app import BackgroundCluster
from splitserve.cluster.config import ClusterConfig
from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig
from splitserve.wire.faults import ArmedFault, HandoffFault
from splitserve.wire.sampling import SamplingParams

F = HandoffFault
CHECKS = {"IntegrityError": "checksum", "LeaseExpired": "lease", "MeaningMismatch": "meaning"}
LEASE_S = 5.0  # a correct handoff on a loaded CI machine pulls well within it
MAX_TOKENS = 8
BLOCK_SIZE = 8
PROMPT_LEN = 37  # five blocks of 8, the last one partly filled
IDLE_DEADLINE_S = 120.0


@dataclass(frozen=True)
class Setup:
    """A cluster to inject faults into: a tiny random model of ``kind`` (``bench.tiny_models``),
    a prefill worker of ``prefill_tp`` ranks, a TP=1 decode worker."""

    name: str
    kind: str
    prefill_tp: int = 1
    kv_cache_dtype: str = "auto"
    faults: tuple[HandoffFault, ...] = ()

    def engine(self) -> dict:
        return {
            "kv_cache_memory_mib": 16,
            "max_num_batched_tokens": 256,
            "block_size": BLOCK_SIZE,
            "kv_cache_dtype": self.kv_cache_dtype,
        }

    def config(self, model: str, verify_meaning: float) -> ClusterConfig:
        return ClusterConfig.model_validate(
            {
                "policy": {"conditional_disaggregation": False},  # every prompt to the prefill worker
                "mode": "disaggregated",
                "model": {"name": model, "dtype": "float32"},
                "prefill": {"num_cpus": 0.5, "tp_size": self.prefill_tp, "engine": self.engine()},
                "decode": {"num_cpus": 0.5, "engine": self.engine()},
                "router": {"port": 0, "http_port": 0, "shutdown_grace_s": 1},
                "transfer": {"verify_meaning": verify_meaning, "lease_s": LEASE_S, "stream_layers": False},
            }
        )


SETUPS = (
    Setup(
        "Llama float32, prefill TP2 -> decode TP1",
        "llama",
        prefill_tp=2,
        faults=(
            F.SOURCE_BYTES_CHANGED,
            F.SOURCE_BLOCK_REUSED,
            F.PULL_AFTER_LEASE,
            F.BLOCK_TABLE_PERMUTED,
            F.LAYERS_SWAPPED,
            F.KV_HEADS_SWAPPED,
            F.PREFIX_BLOCK_OTHER_TOKENS,
        ),
    ),
    Setup("Llama float32, FP8 KV cache", "llama", kv_cache_dtype="fp8", faults=(F.FP8_SCALES_SWAPPED,)),
    Setup("DeepSeek-V3 (MLA)", "deepseek_v3", faults=(F.MLA_PARTS_SWAPPED,)),
)


@dataclass(frozen=True)
class Row:
    fault: HandoffFault | None  # None: the clean request before the faults
    caught_by: str  # "checksum", "lease", "meaning", another error's name, or "" (nothing failed)
    tokens_equal: bool  # the client's tokens are the monolithic engine's
    held_after: int  # KV blocks (and exports) held on any worker once the cluster is idle
    detect_ms: float | None  # first token -> kv_recompute (None: no recompute)
    detail: str  # the kv_recompute mark's sentence

    @property
    def caught(self) -> bool:
        return self.caught_by in CHECKS.values()


def reference(model: str, setup: Setup, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """The monolithic engine's greedy tokens (same dtype and KV cache as the workers)."""
    config = EngineConfig(
        model=model,
        dtype="float32",
        block_size=BLOCK_SIZE,
        kv_cache_memory_mib=16,
        kv_cache_dtype=setup.kv_cache_dtype,
    )
    return [c.token_ids for c in Engine(config).generate(prompts, params)]


def prompts_for(n: int, vocab: int, seed: int = 11) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(PROMPT_LEN)] for _ in range(n)]


def run_faults(
    cluster: BackgroundCluster,
    faults: tuple[HandoffFault | None, ...],
    prompts: list[list[int]],
    want: list[list[int]],
) -> list[Row]:
    """Send one greedy request per entry of ``faults`` (None: no fault), each armed on the
    worker its fault strikes at, one after another; a row each."""
    from splitserve.client import Client

    rows = []
    with Client(cluster.address) as client:
        for fault, prompt, expected in zip(faults, prompts, want, strict=True):
            rid = f"fault-{'none' if fault is None else fault.name.lower()}-{uuid.uuid4().hex[:6]}"
            if fault is not None:
                ray.get(_worker(cluster, fault).arm_fault.remote(ArmedFault(rid, fault)))
            before = cluster.run(_failures(cluster))
            out = client.generate(
                prompt,
                request_id=rid,
                temperature=0,
                max_tokens=MAX_TOKENS,
                ignore_eos=True,
                timeout_ms=120_000,
            )
            after = cluster.run(_failures(cluster))
            failed = [name for name, n in after.items() if n > before.get(name, 0)]
            trace = cluster.run(_trace(cluster, rid))
            rows.append(
                Row(
                    fault,
                    ", ".join(CHECKS.get(name, name) for name in failed),
                    out.token_ids == expected,
                    _idle(client),
                    _detect_ms(trace),
                    next((m.detail for m in trace.marks if m.name == "kv_recompute"), ""),
                )
            )
    return rows


def _worker(cluster: BackgroundCluster, fault: HandoffFault):
    """The actor a fault strikes at: the prefill worker's rank 0 (its export) or the decode worker."""
    pool = cluster.cluster.pools["prefill" if fault.side == "source" else "decode"]
    (worker,) = pool.workers
    return pool.actors(worker.worker_id)[0]


async def _failures(cluster: BackgroundCluster) -> dict[str, int]:
    """The router's failed transfers so far, by error (read on its loop)."""
    counts: dict[str, int] = {}
    for (error, _action), n in cluster.dispatcher.transfer_failures.items():
        counts[error] = counts.get(error, 0) + n
    return counts


async def _trace(cluster: BackgroundCluster, request_id: str):
    return next(t for t in reversed(cluster.dispatcher.traces.latest(1000)) if t.request_id == request_id)


def _detect_ms(trace) -> float | None:
    first, failed = trace.at("first_token"), trace.at("kv_recompute")
    return None if first is None or failed is None else (failed - first) * 1e3


def _idle(client) -> int:
    """Wait (``IDLE_DEADLINE_S`` at most) until no worker holds KV blocks or exports; what
    they hold then (0 once idle)."""
    deadline = time.monotonic() + IDLE_DEADLINE_S
    while True:
        st = client.cluster_status()
        held = sum(w.kv_blocks_used + w.kv_exports_held for p in st.pools for w in p.workers)
        if held == 0 or time.monotonic() > deadline:
            return held
        time.sleep(0.1)


def run_setup(setup: Setup, directory: Path, verify_meaning: float, log=print) -> list[Row]:
    """``setup``'s cluster on a Ray of its own, its clean request and its faults."""
    from transformers import AutoConfig

    from splitserve.bench import harness
    from splitserve.bench.tiny_models import make_hf_checkpoint

    model = str(directory / setup.kind)
    if not Path(model).exists():
        make_hf_checkpoint(setup.kind, Path(model))
    faults = (None, *setup.faults)
    prompts = prompts_for(len(faults), AutoConfig.from_pretrained(model).vocab_size)
    want = reference(model, setup, prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    log(f"{setup.name}, meaning check {'on' if verify_meaning else 'off'}: starting the cluster")
    with harness.served(setup.config(model, verify_meaning)) as cluster:
        return run_faults(cluster, faults, prompts, want)


def table(setup: Setup, rows: list[Row], verify_meaning: float) -> list[list[str]]:
    check = "on" if verify_meaning else "off"
    return [
        [
            setup.name,
            "none (a correct handoff)" if r.fault is None else r.fault.value,
            check,
            r.caught_by or ("nothing failed" if r.fault is None else "not caught"),
            "equal" if r.tokens_equal else "DIFFERENT",
            str(r.held_after),
            "" if r.detect_ms is None else f"{r.detect_ms:.0f}",
            r.detail,
        ]
        for r in rows
    ]


HEADER = ["setup", "fault", "meaning check", "caught by", "tokens", "blocks held after", "detect ms", "trace"]
