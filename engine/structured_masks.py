"""The masks a batch step applies for its rows' grammars (``engine.structured``):
llguidance fills a bitmask per row, 32 tokens per int32 word, the rows in parallel."""

from __future__ import annotations

import numpy as np
import torch

from splitserve.engine.structured import Grammar

_EXECUTOR = None  # llguidance's thread pool for filling many rows' masks at once


def allows(grammars: list[Grammar], tokens: torch.Tensor) -> list[bool]:
    """Whether each grammar allows its token next (``tokens``: one per grammar)."""
    bitmask = _bitmasks(grammars)
    return [bool((int(bitmask[i, t >> 5]) >> (t & 31)) & 1) for i, t in enumerate(tokens.tolist())]


def _bitmasks(grammars: list[Grammar]) -> torch.Tensor:
    """[len(grammars), words] int32: the tokens each grammar allows next, 32 per word
    (token ``32 * w + b`` is bit ``b`` of word ``w``), filled by llguidance (the rows in
    parallel)."""
    import llguidance.torch

    global _EXECUTOR
    vocab = grammars[0].vocab_size  # one tokenizer per engine
    bitmask = torch.zeros(len(grammars), (vocab + 31) // 32, dtype=torch.int32)
    if len(grammars) == 1:
        llguidance.torch.fill_next_token_bitmask(grammars[0].matcher, bitmask, 0)
    else:
        if _EXECUTOR is None:
            _EXECUTOR = llguidance.LLExecutor()
        matchers = [(g.matcher, i) for i, g in enumerate(grammars)]
        llguidance.torch.fill_next_token_bitmask_par(_EXECUTOR, matchers, bitmask)
    return bitmask


def allowed_tokens(grammars: list[Grammar], width: int, device: torch.device) -> torch.Tensor:
    """[len(grammars), width] bool: the tokens each grammar allows next (False past the
    tokenizer's vocabulary). The bitmask is unpacked here rather than with
    ``llguidance.torch.apply_token_bitmask_inplace``, which compiles a kernel with
    ``torch.compile`` on the CPU."""
    vocab = grammars[0].vocab_size
    bitmask = _bitmasks(grammars)
    # little-endian words: byte k of a row holds tokens 8k..8k+7, lowest bit first
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    bits = torch.from_numpy(bits).view(torch.bool).to(device)  # 0/1 bytes are bools already
    if width > vocab:
        bits = torch.cat([bits, bits.new_zeros(len(grammars), width - vocab)], dim=1)
    return bits[:, :width]
