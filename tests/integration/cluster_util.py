"""Shared pieces of the cluster tests: a tiny-model config, concurrent streams,
and waiting for KV occupancy to drain (as the status service reports it)."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import ray
from prometheus_client.parser import text_string_to_metric_families

from splitserve.cli.main import main
from splitserve.client import Chunk, Client, Completion, Final, Unavailable
from splitserve.cluster.app import BackgroundCluster, start_local_ray
from splitserve.cluster.config import ClusterConfig
from splitserve.engine.engine import Engine
from splitserve.wire.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.integration.holding import hold
from tests.waiting import wait_until

__all__ = ["wait_until"]  # re-exported: the integration tests take it from here

VOCAB = 512


def tiny_config(checkpoint: str, mode: str = "disaggregated", **overrides) -> ClusterConfig:
    """A cluster of the tiny model. Every prompt goes to a prefill worker (the decider
    is off), so each request exercises the KV handover; tests of the decider turn it on.
    Every handoff and move is checked by meaning (``transfer.verify_meaning: always``,
    unless ``transfer`` says otherwise): the cluster tests' tokens hold with it on."""
    pool = {"num_cpus": 1, "engine": {"kv_cache_memory_mib": 16, "max_num_batched_tokens": 256}}
    data = {
        "policy": {"conditional_disaggregation": False},
        "mode": mode,
        "model": {"name": checkpoint, "dtype": "float32"},
        "prefill": pool,
        "decode": pool,
        "colocated": {**pool, "replicas": 2},
        "router": {"port": 0, "http_port": 0, "shutdown_grace_s": 1},
        "limits": {"max_inflight_requests": 64},
    }
    overrides["transfer"] = {"verify_meaning": "always", **overrides.get("transfer", {})}
    data.update(overrides)
    return ClusterConfig.model_validate(data)


def shared_ray() -> None:
    """The suite's Ray instance (2 CPUs, as on CI): started by the first module that
    needs it, kept for the next (a start and stop of Ray cost about 4.5 s here, and
    every module used to pay them), ended with the session (``tests/conftest.py``).
    A module that needs a Ray of its own (several nodes, another size) calls
    ``own_ray`` first.

    Ray's own startup is tried twice (``start_local_ray``)."""
    if ray.is_initialized():
        return
    start_local_ray(2, object_store_memory=300 * 2**20, log_to_driver=False)


def own_ray() -> None:
    """Before a module starts a Ray of its own: the shared one goes (the next module
    that needs it starts it again)."""
    ray.shutdown()


@contextlib.contextmanager
def live_cluster(config: ClusterConfig) -> Iterator[BackgroundCluster]:
    """A cluster on the suite's shared Ray instance, for one test module (or test).
    On the way out it waits until the cluster's actors have released what they held
    (Ray frees it after their processes end), so the next cluster finds the whole
    instance; if that does not come, Ray is restarted rather than handed on short."""
    shared_ray()
    with BackgroundCluster(config) as c:
        yield c
    try:
        wait_until(_ray_idle, "the cluster's actors gone and their resources free", timeout=60)
    except AssertionError as e:
        logging.getLogger(__name__).warning("%s; restarting Ray for the next module", e)
        ray.shutdown()


def _ray_idle() -> bool:
    total, free = ray.cluster_resources(), ray.available_resources()
    return all(
        free.get(k, 0.0) >= v
        for k, v in total.items()
        if not k.startswith(("node:", "memory", "object_store"))
    )


def mixed_workload(n: int = 32, seed: int = 7) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of 3..300 tokens and outputs of 1..40 tokens, some ending at a stop token,
    every third with penalties, a logit bias and min_tokens (greedy all: the tokens
    depend on the request's own history only, which the handoff must carry whole)."""
    lengths = [3 + (i * 97) % 298 for i in range(n)]
    prompts = random_prompts(lengths, VOCAB, seed=seed)
    params = []
    for i in range(n):
        stop = (7, 11) if i % 4 == 0 else ()  # some requests may end early, by a stop token
        max_tokens = 1 + (i * 13) % 40
        processing = {}
        if i % 3 == 2:
            processing = dict(
                repetition_penalty=1.4,
                frequency_penalty=0.5,
                presence_penalty=0.3,
                logit_bias={5: 2.0, 9: -1.0},
                min_tokens=min(3, max_tokens),
            )
        params.append(SamplingParams(max_tokens=max_tokens, stop_token_ids=stop, **processing))
    return prompts, params


def reference_tokens(engine: Engine, prompts, params) -> list[list[int]]:
    return [c.token_ids for c in engine.generate(prompts, params)]


def stream_all(
    address: str | list[str], prompts, params, timeout: float = 120
) -> list[tuple[Completion, int]]:
    """Stream every request at once, one thread each (a client of ``address``: one router,
    or several); returns (completion, number of chunks)."""

    def one(i):
        out, chunks = Completion(), 0
        with Client(address, timeout=timeout) as client:
            for item in client.stream(prompts[i], **_options(params[i])):
                chunks += isinstance(item, Chunk)
                out.add(item)
        return out, chunks

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))


def _options(p: SamplingParams) -> dict:
    """``p`` as the SDK's options (a field the SDK leaves unset gets the server's default:
    temperature 1.0, so the temperature is always sent)."""
    return dict(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        repetition_penalty=p.repetition_penalty,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
        logit_bias=dict(p.logit_bias),
        min_tokens=p.min_tokens,
    )


def assert_kv_moved(finals, client: Client) -> None:
    """Each request's prompt KV moved from a prefill worker to its decode worker. Equal
    tokens alone do not show it: a failed transfer is recomputed on the decode worker
    (``transfer.on_failure: recompute``) with the same tokens. So: no transfer failed
    (the router's count, since the cluster started), and every request that went past
    its first token reports a pull (``kv_pull_ms`` is set only by a pull that landed)."""
    failed = transfer_failures(client)
    assert failed == {}, f"KV transfers failed and were recomputed: {failed}"
    for f in finals:
        assert f.prefill_worker.startswith("prefill"), f"prefilled on {f.decode_worker}, not handed over"
        assert f.completion_tokens <= 1 or f.kv_pull_ms > 0, (
            f"no KV pulled for a {f.completion_tokens}-token run"
        )


def transfer_failures(client: Client) -> dict[tuple[str, str], int]:
    """The router's count of failed KV transfers since the cluster started, by (error class,
    "recompute" or "fail"): a failed pull, a move's included, adds one."""
    return {(f.error, f.action): f.count for f in client.cluster_status().transfer_failures}


def trace_of(traces, request_id: str):
    """The trace of ``request_id`` among ``traces`` (``cluster_status(traces=n).traces``,
    or the dispatcher's ``TraceLog.latest``)."""
    (trace,) = [t for t in traces if t.request_id == request_id]
    return trace


def assert_move_pulled(trace, to: str) -> None:
    """The request of ``trace`` moved with its KV, ending on decode worker ``to``: every
    ``moved`` mark is followed by the new worker's pull (``move_pulled``, marked only when
    the worker it moved to reports a pull that landed), and nothing was computed again (no
    ``kv_recompute``, which a failed pull marks: the tokens would be equal all the same).
    The caller checks that the router's ``transfer_failures`` did not change."""
    names = [m.name for m in trace.marks]
    pulled = [m.worker for m in trace.marks if m.name == "move_pulled"]
    assert "kv_recompute" not in names, f"{trace.request_id} was recomputed: {names}"
    assert names.count("moved") == len(pulled) >= 1, f"{trace.request_id}: a move pulled no KV: {names}"
    assert pulled[-1] == to, f"{trace.request_id} pulled on {pulled}, ended on {to}"


def drain_mid_stream(cluster, client: Client, prompt: list[int], request_id: str, max_tokens: int):
    """A greedy stream of ``prompt`` whose decode worker is drained (``splitserve drain``)
    once 10 tokens came: (its tokens, its ``Final``, the drained worker's id). The request
    is held there at its 10th token (``holding.hold``) until the drain returns: the drain
    finds it running, however fast the worker decodes and however long the drain takes to
    come (a request that ended first would finish on the drained worker, moved by nothing)."""
    tokens, final, drained = [], None, None
    options = dict(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, request_id=request_id)
    with hold(cluster, request_id, at=10) as held:
        for item in client.stream(prompt, **options):
            if isinstance(item, Final):
                final = item
                continue
            tokens += item.token_ids
            if drained is None and len(tokens) >= 10:
                st = client.cluster_status()
                (drained,) = [
                    w.worker_id for p in st.pools for w in p.workers if w.role == "decode" and w.running
                ]
                try:
                    assert main(["drain", drained, "--server", cluster.address]) == 0
                finally:
                    held.release()
    return tokens, final, drained


def kv_used(client: Client) -> dict[str, int]:
    st = client.cluster_status()
    return {w.worker_id: w.kv_blocks_used + w.kv_exports_held for p in st.pools for w in p.workers}


def wait_kv_free(client: Client, timeout: float = 60.0) -> dict[str, int]:
    """Poll the status service until no worker holds KV; returns that reading (KV
    blocks used per worker: every one 0). Each reading replaces the last: a worker
    gone from the status since (killed, replaced) holds nothing any more."""
    used: dict[str, int] = {}

    def free() -> bool:
        used.clear()
        used.update(kv_used(client))
        return not any(used.values())

    wait_until(free, "no worker holds KV", timeout, 0.1)
    return used


def cancel_mid_stream(client: Client, seed: int = 3) -> dict[str, int]:
    """Start a long stream, read 3 chunks, check KV is held, cancel; returns the KV
    each worker still holds once it drained (all zeros when every block was freed)."""
    prompt = random_prompts([200], VOCAB, seed=seed)[0]
    stream = client.stream(prompt, temperature=0, max_tokens=800, ignore_eos=True)
    for _ in range(3):
        next(stream)
    if sum(kv_used(client).values()) == 0:
        raise AssertionError("the request holds no KV mid-stream: nothing to free")
    stream.close()  # the client cancels the call
    return wait_kv_free(client)


def scrape(cluster) -> dict[tuple[str, frozenset], float]:
    """The router's Prometheus metrics now, by (name, labels)."""
    with urllib.request.urlopen(f"http://{cluster.http_address}/metrics", timeout=60) as r:
        text = r.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(values: dict, name: str, **labels) -> float:
    """The sum of a metric's samples that carry these labels (0 when it has none yet)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in values.items() if n == name and want <= ls)


def streams_through_a_fault(
    address: str, prompts, max_tokens: int, retries: int = 0
) -> Callable[[float], list[tuple[str, list[int]]]]:
    """Greedy streams of ``prompts`` (``ignore_eos``), one thread and one connection each,
    running once this returns (each has had a token). Break something, then call the
    returned function: it waits for every stream (failing if one hangs past its
    timeout) and gives each one's outcome, "OK", "UNAVAILABLE" or the error, and the
    tokens it received."""
    outcomes: list[tuple[str, list[int]]] = [("NOT RUN", [])] * len(prompts)
    streaming = [threading.Event() for _ in prompts]

    def one(i: int) -> None:
        tokens: list[int] = []
        try:
            with Client(address, timeout=120, retries=retries) as c:
                for item in c.stream(prompts[i], temperature=0, max_tokens=max_tokens, ignore_eos=True):
                    if isinstance(item, Chunk):
                        tokens.extend(item.token_ids)
                        streaming[i].set()
            outcomes[i] = ("OK", tokens)
        except Unavailable:
            outcomes[i] = ("UNAVAILABLE", tokens)
        except Exception as e:  # reported by the caller's assertions
            outcomes[i] = (f"{type(e).__name__}: {e}", tokens)
        finally:
            streaming[i].set()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for e in streaming:
        assert e.wait(120), "a stream got no token"

    def finish(timeout: float) -> list[tuple[str, list[int]]]:
        for t in threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in threads), "a stream hung"
        return outcomes

    return finish


def process_exited(pid: int) -> bool:
    """Whether process ``pid`` (of this machine) has exited: gone, or a zombie (its
    memory freed; only its parent has yet to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def post_json(url: str, body: dict) -> tuple[int, str]:
    """POST ``body`` as JSON to ``url`` on a connection of its own: (HTTP status, body text),
    an error status included."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
