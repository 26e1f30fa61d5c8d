"""Process bodies for the tensor-parallel tests: each rank of a TP group runs in
its own spawned process (gloo over localhost) and reports through a queue."""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass

import torch

from splitserve.engine.engine import Engine
from splitserve.engine.parallel.group import TPGroup
from splitserve.wire.config import EngineConfig
from splitserve.wire.sampling import SamplingParams
from splitserve.wire.tp import TPInit


@dataclass(frozen=True)
class RankJob:
    rank: int
    size: int
    port: int
    config: EngineConfig
    prompts: list[list[int]]
    params: SamplingParams


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(job: RankJob) -> tuple[TPGroup, Engine]:
    torch.set_num_threads(1)
    group = TPGroup.join(
        TPInit(job.rank, job.size, f"tcp://127.0.0.1:{job.port}", timeout_s=120), torch.device("cpu")
    )
    return group, Engine(job.config, tp=group)


def _exit(out=None) -> None:
    """End a rank process that finished its work: flush what it reported, then exit
    without running C++ static destructors. gloo's transport threads outlive
    ``destroy_process_group`` (torch keeps the device), and destroying them at
    interpreter exit aborts the process now and then ("terminate called without
    an active exception", seen about one run in six)."""
    if out is not None:
        out.close()
        out.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def generate_rank(job: RankJob, out) -> None:
    """Rank 0 generates and puts the token ids; the others put how many steps they followed."""
    group, engine = _join(job)
    try:
        if group.is_driver:
            done = engine.generate(job.prompts, job.params)
            engine.stop_followers()
            out.put(("tokens", [c.token_ids for c in done]))
        else:
            out.put(("steps", engine.follow()))
    finally:
        group.destroy()
    _exit(out)


def expert_parallel_rank(job: RankJob, out) -> None:
    """An expert-parallel group: rank 0 generates the prompts twice (the second pass
    hits the prefix cache) and puts ("tokens", both passes' token ids, the second's
    cached token counts, the preemptions); every rank then puts ("ran", its rank, the
    tokens it ran through the model, the rows its experts computed)."""
    group, engine = _join(job)
    try:
        if group.is_driver:
            first = engine.generate(job.prompts, job.params)
            again = engine.generate(job.prompts, job.params)
            engine.stop_followers()
            passes = [[c.token_ids for c in first], [c.token_ids for c in again]]
            cached = [c.num_cached_tokens for c in again]
            out.put(("tokens", passes, cached, engine.scheduler.num_preemptions))
        else:
            engine.follow()
        routed = sum(sum(m.take_routed()) for m in engine.model.moe_layers())
        out.put(("ran", group.rank, engine.runner.tokens_run, routed))
    finally:
        group.destroy()
    _exit(out)


def capacity_rank(job: RankJob, out) -> None:
    """Each rank puts (its rank, its engine's KV capacity); no step is run."""
    group, engine = _join(job)
    try:
        out.put((job.rank, engine.capacity))
    finally:
        group.destroy()
    _exit(out)


def logits_rank(job: RankJob, out) -> None:
    """Rank 0 puts the logits at every position of each prompt (teacher-forced)."""
    from splitserve.bench.quant_accuracy import prompt_logits

    group, engine = _join(job)
    try:
        if group.is_driver:
            logits = [prompt_logits(engine, p).numpy() for p in job.prompts]  # by value, not shared memory
            engine.stop_followers()
            out.put(logits)
        else:
            engine.follow()
    finally:
        group.destroy()
    _exit(out)


@dataclass(frozen=True)
class ExportedShard:
    rank: int
    handshake: object
    descriptors: list  # KVDescriptor per prompt, in prompt order
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]  # the first sampled token (driver only; else empty)


def prefill_export_rank(job: RankJob, backend: str, out, done, reader_tp: int = 1) -> None:
    """Prefill every prompt under TP, export each rank's KV shard through ``backend`` for
    a decode group of ``reader_tp`` ranks, put an ``ExportedShard``, then serve reads
    until ``done`` is set."""
    from splitserve.kv_transfer import get_backend
    from splitserve.kv_transfer.tp_mapping import readers_of
    from splitserve.wire.kv import CompatInfo

    group, engine = _join(job)
    source = get_backend(backend).source(
        f"prefill-tp{job.rank}",
        engine.kv_cache.tensor,
        CompatInfo(job.config.model, engine.kv_cache.layout),
        30.0,
    )
    try:
        if group.is_driver:
            ids = [engine.add_request(p, job.params, prefill_only=True) for p in job.prompts]
            while engine.has_unfinished():
                engine.step()
            prefilled = [engine.prefilled(i) for i in ids]
            engine.stop_followers()
            plan = group.broadcast_object([(p.request_id, p.block_ids, p.num_kv_tokens) for p in prefilled])
            firsts = [p.output_token_ids for p in prefilled]
            prompts = [p.prompt_token_ids for p in prefilled]
        else:
            engine.follow()
            plan = group.broadcast_object()  # the driver's block ids hold this rank's shard too
            firsts, prompts = [], []
        readers = readers_of(job.rank, job.size, reader_tp, engine.model_config.num_kv_heads)
        descs = [source.export(rid, blocks, n, readers=readers) for rid, blocks, n in plan]
        out.put(ExportedShard(job.rank, source.handshake(), descs, prompts, firsts))
        while not done.wait(0.005):
            source.poll()
    finally:
        source.close()
        group.destroy()
    _exit(out)


def decode_import_rank(job: RankJob, shards: list[ExportedShard], backend: str, out) -> None:
    """Rank ``job.rank`` of a decode group of ``job.size``: pull its KV heads of every
    prompt the source group exported (``shards``, in rank order) into the blocks rank 0
    allocated, then decode them under TP; rank 0 puts each prompt's tokens (the first,
    sampled by the source, included)."""
    from splitserve.kv_transfer import get_backend
    from splitserve.kv_transfer.tp_mapping import RankSink
    from splitserve.wire.kv import CompatInfo

    group, engine = _join(job)
    compat = CompatInfo(job.config.model, engine.kv_cache.layout)
    name = f"decode-tp{job.rank}"
    sink = RankSink(name, engine.kv_cache.tensor, compat, get_backend(backend).sink, max_blocks=16)
    driver = shards[0]
    try:
        sink.connect([s.handshake for s in shards])
        if group.is_driver:
            blocks = [
                engine.import_request(
                    d.request_id, driver.prompt_token_ids[i], driver.output_token_ids[i], job.params
                )
                for i, d in enumerate(driver.descriptors)
            ]
            group.broadcast_object(blocks)
        else:
            blocks = group.broadcast_object()
        for i, own in enumerate(blocks):
            sink.pull(tuple(s.descriptors[i] for s in shards), own, timeout=30.0)
        group.gather_object(None)  # every rank's heads are in place
        if group.is_driver:
            got: dict[str, list[int]] = {}
            for d in driver.descriptors:
                engine.activate(d.request_id)
            while engine.has_unfinished():
                for o in engine.step():
                    got.setdefault(o.request_id, []).extend(o.new_token_ids)
            engine.stop_followers()
            out.put(
                [driver.output_token_ids[i] + got[d.request_id] for i, d in enumerate(driver.descriptors)]
            )
        else:
            engine.follow()
    finally:
        sink.close()
        group.destroy()
    _exit(out)


def prefill_rank_main(spec) -> None:
    """Host one ``PrefillRank`` (rank >= 1) in this process until rank 0 stops the group."""
    from splitserve.prefill_worker.tp import PrefillRank

    PrefillRank(spec).wait()
    _exit()


def decode_rank_main(spec) -> None:
    """Host one ``DecodeRank`` (rank >= 1) in this process until rank 0 stops the group."""
    from splitserve.decode_worker.tp import DecodeRank

    DecodeRank(spec).wait()
    _exit()
