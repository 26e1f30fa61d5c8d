"""Workloads for the serving benchmark: what to send, and when.

Every request is token ids (no tokenizer round trip, exact lengths) with a
fixed output length sent with ``ignore_eos``, so runs compare. Token ids are
drawn from ``[low_id, vocab_size)`` to keep clear of special tokens.

Datasets (all generated from a seed; nothing is downloaded):

- ``random``: fixed input and output lengths (``range_ratio`` widens them
  uniformly to ``[len * (1 - r), len * (1 + r)]``, as vLLM's random dataset);
- ``sharegpt``: lengths from log-normal distributions with roughly ShareGPT's
  shape (input median ~100 tokens with a long tail, output median ~150);
- ``shared-prefix``: requests behind ``num_prefixes`` system prompts (one by
  default), each request behind one drawn at random: what cache-aware routing
  is for;
- ``mixed``: short chat requests with a fraction of long prompts among them
  (the workload disaggregation is for);
- ``shifting``: a load that shifts from decode-heavy (short prompts, long outputs)
  to prefill-heavy (long prompts, short outputs) and back, a third of the
  requests each: what an elastic cluster's roles should follow;
- ``trace``: replay a JSONL file of ``{"timestamp", "input_len", "output_len"}``;
- ``multi-turn``: chat conversations (``Conversation``) of several turns behind
  ``num_prefixes`` system prompts; each turn re-sends the whole conversation so
  far (the system prompt, every earlier user message and the tokens the server
  answered) and a new user message, after a think time following the previous
  answer. The common case of prefix reuse, and the one a KV tier is for.

Arrivals: gaps from a gamma distribution with shape ``burstiness`` and mean
``1 / rate`` (burstiness 1.0 is a Poisson process; < 1 burstier), as vLLM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class BenchRequest:
    prompt_ids: list[int]
    output_len: int
    arrival_s: float | None = None  # from a trace; otherwise set by the arrival process


def _ids(rng: np.random.Generator, n: int, vocab_size: int, low_id: int) -> list[int]:
    return rng.integers(low_id, vocab_size, size=n).tolist()


def random_requests(n, input_len, output_len, vocab_size, seed=0, range_ratio=0.0, low_id=100):
    rng = np.random.default_rng(seed)

    def length(base: int) -> int:
        lo, hi = int(base * (1 - range_ratio)), int(base * (1 + range_ratio))
        return max(1, int(rng.integers(lo, hi + 1)))

    return [
        BenchRequest(_ids(rng, length(input_len), vocab_size, low_id), length(output_len)) for _ in range(n)
    ]


def sharegpt_like(n, vocab_size, seed=0, max_input=1024, max_output=512, low_id=100):
    rng = np.random.default_rng(seed)
    ins = np.clip(rng.lognormal(np.log(100), 1.0, n), 4, max_input).astype(int)
    outs = np.clip(rng.lognormal(np.log(150), 0.8, n), 1, max_output).astype(int)
    return [BenchRequest(_ids(rng, int(i), vocab_size, low_id), int(o)) for i, o in zip(ins, outs)]


def shared_prefix(n, prefix_len, suffix_len, output_len, vocab_size, seed=0, low_id=100, num_prefixes=1):
    rng = np.random.default_rng(seed)
    prefixes = [_ids(rng, prefix_len, vocab_size, low_id) for _ in range(num_prefixes)]
    picks = rng.integers(0, num_prefixes, size=n)
    return [BenchRequest(prefixes[k] + _ids(rng, suffix_len, vocab_size, low_id), output_len) for k in picks]


def mixed(n, vocab_size, seed=0, long_fraction=0.1, long_len=2048, short_len=128, output_len=64, low_id=100):
    """Short chat requests with every ``1/long_fraction``-th one a long prompt, spread evenly."""
    rng = np.random.default_rng(seed)
    every = max(1, round(1 / long_fraction)) if long_fraction > 0 else 0
    out = []
    for i in range(n):
        is_long = every and i % every == every // 2
        length = long_len if is_long else max(1, int(rng.integers(short_len // 2, short_len * 3 // 2 + 1)))
        out.append(BenchRequest(_ids(rng, length, vocab_size, low_id), output_len))
    return out


def shifting(n, vocab_size, seed=0, short_len=64, long_len=1024, output_len=256, low_id=100):
    """Decode-heavy, then prefill-heavy, then decode-heavy again, a third of ``n`` each
    (in send order): prompts of ``short_len`` (+-50 %) asking ``output_len`` tokens, then
    prompts of ``long_len`` asking ``output_len // 8`` (at least 4)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        if n // 3 <= i < 2 * n // 3:
            out.append(BenchRequest(_ids(rng, long_len, vocab_size, low_id), max(4, output_len // 8)))
        else:
            length = int(rng.integers(max(1, short_len // 2), short_len * 3 // 2 + 1))
            out.append(BenchRequest(_ids(rng, length, vocab_size, low_id), output_len))
    return out


def trace(path: str | Path, vocab_size, seed=0, low_id=100):
    """Requests from a JSONL trace; arrivals are its timestamps, shifted to start at 0."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"trace {path} is empty")
    try:
        rows.sort(key=lambda r: float(r["timestamp"]))
        t0 = float(rows[0]["timestamp"])
        rng = np.random.default_rng(seed)
        return [
            BenchRequest(
                _ids(rng, int(r["input_len"]), vocab_size, low_id),
                int(r["output_len"]),
                float(r["timestamp"]) - t0,
            )
            for r in rows
        ]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"trace {path}: every line needs timestamp, input_len, output_len ({e})") from None


@dataclass(frozen=True)
class Conversation:
    """One chat: its system prompt, then a user message per turn. The history each turn
    re-sends is built while it runs (it holds the server's answers)."""

    system_ids: list[int]
    user_ids: list[list[int]]  # one message per turn
    output_len: int  # tokens asked for in every turn
    think_s: list[float]  # before each turn after the first: the user's pause after the answer

    @property
    def turns(self) -> int:
        return len(self.user_ids)

    def prompt(self, turn: int, answers: list[list[int]]) -> list[int]:
        """Turn ``turn``'s prompt: the system prompt, each earlier turn's user message and
        ``answers[i]``, then this turn's message."""
        ids = list(self.system_ids)
        for i in range(turn):
            ids += self.user_ids[i] + answers[i]
        return ids + self.user_ids[turn]


def multi_turn(
    n, turns, system_len, user_len, output_len, vocab_size, seed=0, num_prefixes=1, think_s=1.0, low_id=100
):
    """``n`` conversations of ``turns`` turns: each behind one of ``num_prefixes`` system
    prompts of ``system_len`` tokens, user messages of ``user_len`` tokens (+-50 %),
    think times exponential with mean ``think_s``."""
    rng = np.random.default_rng(seed)
    systems = [_ids(rng, system_len, vocab_size, low_id) for _ in range(num_prefixes)]
    out = []
    for k in rng.integers(0, num_prefixes, size=n):
        users = [
            _ids(rng, int(rng.integers(max(1, user_len // 2), user_len * 3 // 2 + 1)), vocab_size, low_id)
            for _ in range(turns)
        ]
        pauses = rng.exponential(think_s, size=turns).tolist() if think_s > 0 else [0.0] * turns
        out.append(Conversation(systems[k], users, output_len, pauses))
    return out


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (s from the start) of ``n`` requests at ``rate`` per second;
    ``rate = inf`` sends everything at once."""
    if rate == float("inf"):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be positive")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0  # the first request goes at once
    return np.cumsum(gaps).tolist()
