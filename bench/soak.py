"""A soak with every token checked: thousands of concurrent greedy requests through
a disaggregated cluster whose KV caches are small (sequences get preempted),
with shared prefixes (the prefix caches fill, evict and refill) and cancels.

``--concurrency`` clients send ``--requests`` requests in all, each for a prompt
drawn from a fixed set (``--prefixes`` shared system prompts of
``--prefix-len`` tokens, each followed by a suffix of its own), greedy, 1..``--max-output``
output tokens, some with stop tokens. ``--cancel`` of them are cancelled by their
client after a random number of tokens. Every completed output must equal the
monolithic engine's greedy output for its prompt (computed in this process), and
every cancelled one must be a prefix of it. The resident memory of this process
(router and clients) and of every Ray worker process is sampled each second.

The report states: wrong outputs (goal 0), failures by code, preemptions the
engines made, KV held once the load is over (goal 0), and each process's
resident memory at the end of warm-up (the first fifth of the requests), at
each further tenth, and at the end (goal: flat).

::

    python -m splitserve.bench.soak --requests 5000          # SmolLM2, float32
    python -m splitserve.bench.soak --model DIR --requests 500

``run_soak`` is the same harness for a test, on a cluster it is given.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass

from splitserve.bench import harness
from splitserve.bench.chaos import kv_held
from splitserve.client import AsyncClient, Chunk, Client, SplitserveClientError
from splitserve.cluster.app import BackgroundCluster
from splitserve.cluster.config import ClusterConfig
from splitserve.engine.engine import Engine
from splitserve.wire.sampling import SamplingParams

WORKER_TITLES = ("ray::PrefillWorker", "ray::PrefillRank", "ray::DecodeWorker")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class SoakSpec:
    requests: int = 5000
    concurrency: int = 32
    cancel_fraction: float = 0.1
    warmup_fraction: float = 0.2  # memory is compared from the end of this share of requests
    deadline_s: float = 300.0
    seed: int = 0


@dataclass(frozen=True)
class Outcome:
    """One request as its client saw it, checked as it ended (so the harness keeps no
    tokens of right answers and its own memory stays flat)."""

    prompt: int
    code: str  # "OK", "CANCELLED" (by its client, on purpose) or a gRPC code name
    message: str
    right: bool  # completed: the reference's tokens; cancelled: a prefix of them; else True
    tokens: tuple[int, ...] = ()  # kept only when not right


def _checked(prompt: int, code: str, message: str, tokens: list[int], reference: list[int]) -> Outcome:
    if code == "OK":
        right = tokens == reference
    elif code == "CANCELLED":
        right = tokens == reference[: len(tokens)]
    else:
        right = True  # a failure: counted by its code, not as a wrong answer
    return Outcome(prompt, code, message, right, () if right else tuple(tokens))


@dataclass(frozen=True)
class Memory:
    """One process's resident set, MiB: at the end of warm-up, at each further tenth
    of the requests, and at the end (``profile``)."""

    name: str
    profile: tuple[float, ...]
    peak: float

    @property
    def at_warmup(self) -> float:
        return self.profile[0]

    @property
    def at_end(self) -> float:
        return self.profile[-1]

    @property
    def growth(self) -> float:
        return self.at_end - self.at_warmup

    @property
    def late_growth(self) -> float:
        """Growth over the second half after warm-up: near 0 when what grew was still
        warming up, about half of ``growth`` when it grows steadily (a leak)."""
        return self.at_end - self.profile[len(self.profile) // 2]


@dataclass
class SoakReport:
    outcomes: list[Outcome]
    wrong: list[Outcome]  # completed and not the reference, or cancelled and not a prefix of it
    preemptions: int
    kv_held: dict[str, int]
    memory: list[Memory]
    duration_s: float

    @property
    def codes(self) -> Counter:
        return Counter(o.code for o in self.outcomes)

    def problems(self, max_growth_mib: float) -> list[str]:
        out = []
        if self.wrong:
            out.append(f"{len(self.wrong)} output(s) differ from the reference")
        failed = {c: n for c, n in self.codes.items() if c not in ("OK", "CANCELLED")}
        if failed:
            out.append(f"failed requests: {failed}")
        if any(self.kv_held.values()):
            out.append(f"KV still held afterwards: {self.kv_held}")
        grew = [m for m in self.memory if m.growth > max_growth_mib]
        if grew:
            each = ", ".join(f"{m.name} +{m.growth:.0f} MiB" for m in grew)
            out.append(f"memory grew after warm-up: {each}")
        return out

    def summary(self) -> str:
        c = self.codes
        lines = [
            f"{len(self.outcomes)} requests in {self.duration_s:.0f} s "
            f"({len(self.outcomes) / self.duration_s:.1f} req/s): {c['OK']} completed, "
            f"{c['CANCELLED']} cancelled by their clients, {len(self.wrong)} wrong, "
            f"other: {dict((k, n) for k, n in c.items() if k not in ('OK', 'CANCELLED'))}",
            f"preemptions in the engines: {self.preemptions}; "
            f"KV held afterwards: {sum(self.kv_held.values())} blocks",
            "resident memory, MiB: end of warm-up -> end (growth, in the second half), peak; "
            "then at each tenth of the requests after warm-up:",
            *(
                f"  {m.name:<28} {m.at_warmup:8.1f} -> {m.at_end:8.1f} "
                f"({m.growth:+6.1f}, {m.late_growth:+6.1f})  peak {m.peak:8.1f}\n"
                f"  {'':<28} " + " ".join(f"{x:.0f}" for x in m.profile)
                for m in self.memory
            ),
        ]
        return "\n".join(lines)


def rss_mib(pid: int) -> float | None:
    """Resident memory of process ``pid`` in MiB (Linux ``/proc``); None if it is gone."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, IndexError, ValueError):
        return None


def _worker_processes() -> dict[int, str]:
    """This machine's Ray worker processes (by their process title) -> a name."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if title.startswith(WORKER_TITLES):
            actor_class = title.removeprefix("ray::").split()[0].split(".")[0]  # "ray::Class.method()"
            out[int(entry)] = f"{actor_class}[{entry}]"
    return out


class _MemorySampler:
    """Samples the RSS of this process and of every Ray worker process each ``every_s``."""

    def __init__(self, every_s: float = 1.0):
        self.samples: dict[str, list[float]] = {}
        self.marks: list[dict[str, float]] = []  # one sample per mark()
        self._every = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-memory", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            self.sample()

    def sample(self) -> dict[str, float]:
        now = {}
        for pid, name in [(os.getpid(), "router+clients"), *_worker_processes().items()]:
            rss = rss_mib(pid)
            if rss is not None:
                now[name] = rss
                self.samples.setdefault(name, []).append(rss)
        return now

    def mark(self) -> None:
        """Note every process's memory now (the end of warm-up, then each tenth)."""
        self.marks.append(self.sample())

    def stop(self) -> list[Memory]:
        self._stop.set()
        self._thread.join(10)
        points = [*self.marks, self.sample()]
        first, end = points[0], points[-1]
        return [
            Memory(name, tuple(p.get(name, first[name]) for p in points), max(self.samples[name]))
            for name in sorted(first)
            if name in end
        ]


async def _load(address, prompts, params, reference, spec: SoakSpec, mark) -> list[Outcome]:
    """Send the requests; ``mark()`` is called at the end of warm-up and at each tenth
    of the requests from there."""
    outcomes: list[Outcome] = []
    sent = iter(range(spec.requests))
    warmup = int(spec.requests * spec.warmup_fraction)
    marks = {warmup + k * (spec.requests - warmup) // 10 for k in range(10)}

    async def client_loop(client: AsyncClient, index: int) -> None:
        rng = random.Random(spec.seed * 1000 + index)
        for n in sent:
            if n in marks:
                mark()
            i = rng.randrange(len(prompts))
            p = params[i]
            cancel_after = rng.randint(1, p.max_tokens) if rng.random() < spec.cancel_fraction else None
            tokens: list[int] = []
            code, message = "OK", ""
            stream = client.stream(
                prompts[i],
                temperature=p.temperature,
                max_tokens=p.max_tokens,
                stop_token_ids=list(p.stop_token_ids),
                timeout_ms=int(spec.deadline_s * 1000),
            )
            try:
                async for item in stream:
                    if isinstance(item, Chunk):
                        tokens.extend(item.token_ids)
                    if cancel_after is not None and len(tokens) >= cancel_after:
                        code = "CANCELLED"
                        break
            except SplitserveClientError as e:
                code, message = e.code.name, e.details
            finally:
                await stream.aclose()  # leaving early cancels the call on the server
            outcomes.append(_checked(i, code, message, tokens, reference[i]))

    async with AsyncClient(address) as client:
        await client.list_models()
        await asyncio.gather(*(client_loop(client, k) for k in range(spec.concurrency)))
    return outcomes


def run_soak(
    cluster: BackgroundCluster,
    prompts: list[list[int]],
    params: list[SamplingParams],
    reference: list[list[int]],
    spec: SoakSpec,
) -> SoakReport:
    """Send ``spec.requests`` requests to ``cluster`` and check each against
    ``reference`` (the greedy output of each prompt); returns once the KV has drained
    (or 120 s passed: then ``kv_held`` says what stayed)."""
    sampler = _MemorySampler()
    start = time.monotonic()
    outcomes = asyncio.run(_load(cluster.address, prompts, params, reference, spec, sampler.mark))
    duration = time.monotonic() - start
    deadline = time.monotonic() + 120
    while any(kv_held(cluster.address).values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    memory = sampler.stop()
    wrong = [o for o in outcomes if not o.right]
    with Client(cluster.address, timeout=60) as c:
        preemptions = sum(w.preemptions for p in c.cluster_status().pools for w in p.workers)
    return SoakReport(outcomes, wrong, preemptions, kv_held(cluster.address), memory, duration)


def shared_prefix_prompts(
    n: int, vocab: int, seed: int, prefixes: int, prefix_len: int, max_suffix: int, max_output: int = 48
) -> tuple[list[list[int]], list[SamplingParams]]:
    """``n`` prompts, each one of ``prefixes`` shared prefixes then 1..``max_suffix`` tokens
    of its own; 1..``max_output`` output tokens, every fourth with two stop tokens."""
    rng = random.Random(seed)
    heads = [[rng.randrange(100, vocab) for _ in range(prefix_len)] for _ in range(prefixes)]
    prompts, params = [], []
    for i in range(n):
        tail = [rng.randrange(100, vocab) for _ in range(rng.randint(1, max_suffix))]
        prompts.append(rng.choice(heads) + tail)
        stop = tuple(rng.sample(range(100, vocab), 2)) if i % 4 == 0 else ()
        params.append(SamplingParams(max_tokens=rng.randint(1, max_output), stop_token_ids=stop))
    return prompts, params


def soak_config(model: str, kv_mib: int, dtype: str = "float32") -> ClusterConfig:
    """One prefill and one decode worker with ``kv_mib`` of KV cache each; the decider on
    (short prompts prefilled on the decode worker, the rest handed over)."""
    pool = {"num_cpus": 1, "engine": {"kv_cache_memory_mib": kv_mib, "max_num_batched_tokens": 512}}
    return ClusterConfig.model_validate(
        {
            "mode": "disaggregated",
            "model": {"name": model, "dtype": dtype},
            "transfer": {"verify_meaning": 1.0},  # every handoff checked by meaning too
            "prefill": pool,
            "decode": pool,
            "router": {"port": 0, "http_port": None, "shutdown_grace_s": 1},
            "limits": {"max_inflight_requests": 1024},
        }
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32", help="float32 keeps greedy ties out of the comparison")
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=256, help="distinct prompts, each with its reference")
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=128)
    ap.add_argument("--max-suffix", type=int, default=96)
    ap.add_argument("--max-output", type=int, default=64)
    ap.add_argument(
        "--kv-mib", type=int, default=96, help="KV cache per worker (SmolLM2 fp32: ~2,100 tokens)"
    )
    ap.add_argument("--cancel", type=float, default=0.1, help="share of requests cancelled mid-stream")
    ap.add_argument("--max-growth", type=float, default=64.0, help="MiB a process may grow after warm-up")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    config = soak_config(args.model, args.kv_mib, args.dtype)
    with harness.served(config, num_cpus=None) as cluster:
        with Client(cluster.address, timeout=60) as c:
            vocab = c.list_models()[0].vocab_size
        a = args
        prompts, params = shared_prefix_prompts(
            a.prompts, vocab, a.seed, a.prefixes, a.prefix_len, a.max_suffix, a.max_output
        )
        log(f"reference: {len(prompts)} prompts through the monolithic engine ...")
        engine = Engine(config.engine_config("decode"))
        reference = [c.token_ids for c in engine.generate(prompts, params)]
        del engine
        spec = SoakSpec(args.requests, args.concurrency, args.cancel, seed=args.seed)
        log(f"soak: {spec.requests} requests, {spec.concurrency} at a time ...")
        report = run_soak(cluster, prompts, params, reference, spec)
    print(report.summary())
    problems = report.problems(args.max_growth)
    print("every goal met" if not problems else "NOT MET: " + "; ".join(problems))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
