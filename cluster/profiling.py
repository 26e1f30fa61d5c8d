"""``splitserve plan profile``: what one worker of each phase costs, measured through
a running cluster with the SDK, as the ``SimProfile`` the cluster simulator (and the
SLO planner's optional seed) takes.

Measured through the cluster, not the engine alone, so that the figures include
what a request pays on its way (the router, Ray calls, the KV handover, the
stream back) and the cores the workers share with them::

    prefill   one prompt at a time, ``max_tokens=1``, at several lengths; a line
              fitted to (prompt tokens, TTFT) gives the fixed cost of a step
              (its intercept) and the prompt tokens per second (1 / its slope)
    decode    B requests sent together (they are prefilled together and decode
              as one batch), at several B, each ``decode_repeats`` times; each
              request's time per token after its second one is a decode step at
              batch B; a line fitted to
              (B, step) gives ``a + b * B``
    handover  at B = 1, the gap between the first and the second token less one
              decode step: the KV transfer and the decode worker's admission
    sharing   with ``interference`` (workers that share a machine's cores): a
              B = 1 decode step while prompts keep the prefill pool busy, and
              the longest prompt's TTFT while a batch keeps the decode pool
              busy, each against its figure alone, give the slowdowns

Prompts are fresh random token ids (no prefix-cache hits) shorter than a step's
token budget (no chunking), which is the regime the simulator models. For a
cluster whose router prefills short prompts on the decode worker
(``policy.conditional_disaggregation``), profile one with it off: the simulator
sends every prompt to a prefill worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
from dataclasses import dataclass

from splitserve.client import AsyncClient
from splitserve.cluster.config import ClusterConfig
from splitserve.cluster.simulator import SimProfile
from splitserve.loadgen import workloads
from splitserve.loadgen.metrics import RequestRecord
from splitserve.loadgen.serve import run_load
from splitserve.router.step_time import fit_line


@dataclass(frozen=True)
class ProfilePlan:
    """What to measure."""

    prompt_lens: tuple[int, ...] = (32, 128, 256, 384, 480)
    prefill_repeats: int = 4
    batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    decode_repeats: int = 3
    decode_prompt_len: int = 32
    decode_output_len: int = 64
    max_batch: int = 256  # the decode workers' max_num_seqs (not measured: configured)
    max_batched_tokens: int = 512  # the prefill workers' token budget per step
    start_s: float = 30.0  # a new worker's start until routable (not measured here)
    interference: bool = True  # measure the slowdowns of workers sharing cores
    seed: int = 0


def plan_for(config: ClusterConfig, **fields) -> ProfilePlan:
    """A plan with the batch limits ``config``'s workers run with (not measured)."""
    return ProfilePlan(
        max_batch=config.decode.engine.max_num_seqs,
        max_batched_tokens=config.prefill.engine.max_num_batched_tokens,
        **fields,
    )


@dataclass(frozen=True)
class ProfileMeasurements:
    """The raw points the profile is fitted to (seconds)."""

    prefill: tuple[tuple[int, float], ...]  # (prompt tokens, TTFT)
    decode: tuple[tuple[int, float], ...]  # (batch, step)
    handover: tuple[float, ...]  # per B = 1 request
    decode_shared: tuple[float, ...] = ()  # B = 1 steps while the prefill pool is busy
    prefill_shared: tuple[float, ...] = ()  # longest prompt's TTFT while the decode pool is busy


def decode_step_s(rec: RequestRecord) -> float | None:
    """Seconds per token after the second token (the request was in the decode batch
    throughout); None when it produced too few tokens to tell."""
    if len(rec.chunk_times) < 3:
        return None
    return (rec.chunk_times[-1] - rec.chunk_times[1]) / sum(rec.chunk_tokens[2:])


async def _run(
    address: str, reqs: list[workloads.BenchRequest], concurrency: int | None
) -> list[RequestRecord]:
    records, _ = await run_load(address, reqs, [0.0] * len(reqs), concurrency, progress=False)
    failed = [r.error or "no tokens" for r in records if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} profiling request(s) failed, e.g.: {failed[0]}")
    return records


async def measure(address: str, plan: ProfilePlan) -> ProfileMeasurements:
    async with AsyncClient(address, retries=2, timeout=60) as probe:
        (model,) = await probe.list_models()
    vocab, seed = model.vocab_size, plan.seed
    too_long = max(plan.prompt_lens) + 1 > min(plan.max_batched_tokens, model.max_model_len)
    if too_long:
        raise ValueError("profile prompt lengths must fit one prefill step and the model's context")
    # Warm-up: the first requests pay one-off costs (allocation, handshakes).
    await _run(address, workloads.random_requests(4, 64, 8, vocab, seed=seed + 999), None)

    prefill = []
    for i, n in enumerate(plan.prompt_lens):
        reqs = workloads.random_requests(plan.prefill_repeats, n, 1, vocab, seed=seed + 1 + i)
        prefill += [(n, r.ttft) for r in await _run(address, reqs, 1)]

    decode, handover = [], []
    for i, b in enumerate(plan.batches * plan.decode_repeats):
        reqs = workloads.random_requests(
            b, plan.decode_prompt_len, plan.decode_output_len, vocab, seed=seed + 100 + i
        )
        records = await _run(address, reqs, None)
        steps = [s for s in map(decode_step_s, records) if s is not None]
        decode.append((b, statistics.median(steps)))
        if b == 1:
            handover += [r.itls[0] - decode[-1][1] for r in records]
    m = ProfileMeasurements(tuple(prefill), tuple(decode), tuple(handover))
    if plan.interference:
        m = dataclasses.replace(m, **await _measure_sharing(address, plan, vocab))
    return m


class _Background:
    """Requests streamed one after another (``loop``) or all at once, until stopped;
    ``started`` is set when the first token arrives."""

    def __init__(self, address: str, reqs: list[workloads.BenchRequest], loop: bool):
        self.started, self._stop = asyncio.Event(), False
        self._task = asyncio.ensure_future(self._run(address, reqs, loop))

    async def _run(self, address: str, reqs: list[workloads.BenchRequest], loop: bool) -> None:
        async with AsyncClient(address, retries=0, timeout=300) as client:

            async def one(req: workloads.BenchRequest) -> None:
                async for _ in client.stream(
                    req.prompt_ids, temperature=0, max_tokens=req.output_len, ignore_eos=True
                ):
                    self.started.set()

            if not loop:
                await asyncio.gather(*map(one, reqs))
                return
            i = 0
            while not self._stop:
                await one(reqs[i % len(reqs)])
                i += 1

    async def wait_started(self) -> None:
        """Until the first token; the background's error if it ends first (never a hang)."""
        started = asyncio.ensure_future(self.started.wait())
        await asyncio.wait({self._task, started}, return_when=asyncio.FIRST_COMPLETED)
        if not self.started.is_set():
            started.cancel()
            self._task.result()  # raises what ended it
            raise RuntimeError("background profiling requests produced no tokens")

    async def stop(self) -> None:
        self._stop = True
        await self._task


async def _measure_sharing(address: str, plan: ProfilePlan, vocab: int) -> dict:
    seed, longest = plan.seed + 500, max(plan.prompt_lens)
    prompts = workloads.random_requests(64, longest, 1, vocab, seed=seed)  # keeps prefill busy
    busy = _Background(address, prompts, loop=True)
    await busy.wait_started()
    reqs = workloads.random_requests(
        plan.decode_repeats, plan.decode_prompt_len, plan.decode_output_len, vocab, seed=seed + 1
    )
    records = await _run(address, reqs, 1)
    await busy.stop()
    decode_shared = tuple(s for s in map(decode_step_s, records) if s is not None)

    batch = workloads.random_requests(
        8, plan.decode_prompt_len, 400, vocab, seed=seed + 2
    )  # keeps decode busy
    busy = _Background(address, batch, loop=False)
    await busy.wait_started()
    reqs = workloads.random_requests(plan.prefill_repeats, longest, 1, vocab, seed=seed + 3)
    records = await _run(address, reqs, 1)
    await busy.stop()
    return {"decode_shared": decode_shared, "prefill_shared": tuple(r.ttft for r in records)}


def fit(m: ProfileMeasurements, plan: ProfilePlan) -> SimProfile:
    """The profile a simulator takes, from the measured points."""
    step_s, per_token_s = fit_line([(float(n), t) for n, t in m.prefill])
    a, b = fit_line([(float(batch), t) for batch, t in m.decode])
    decode_slowdown = prefill_slowdown = 0.0
    if m.decode_shared:
        alone = statistics.median(t for batch, t in m.decode if batch == 1)
        decode_slowdown = max(statistics.median(m.decode_shared) / alone - 1, 0.0)
    if m.prefill_shared:
        longest = max(n for n, _ in m.prefill)
        alone = statistics.median(t for n, t in m.prefill if n == longest)
        prefill_slowdown = max(statistics.median(m.prefill_shared) / alone - 1, 0.0)
    return SimProfile(
        prefill_tokens_per_s=1.0 / per_token_s if per_token_s > 0 else float("inf"),
        prefill_step_s=step_s,
        max_batched_tokens=plan.max_batched_tokens,
        decode_step_s=(a, b),
        max_batch=plan.max_batch,
        transfer_s=max(statistics.median(m.handover), 0.0) if m.handover else 0.0,
        start_s=plan.start_s,
        prefill_slowdown=prefill_slowdown,
        decode_slowdown=decode_slowdown,
    )


def profile(address: str, plan: ProfilePlan) -> tuple[SimProfile, ProfileMeasurements]:
    """Measure the cluster at ``address`` and fit its profile."""
    m = asyncio.run(measure(address, plan))
    return fit(m, plan), m
