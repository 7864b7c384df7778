"""Block arithmetic: how many blocks a number of tokens takes, and what one more step takes from the pool.

Every count of blocks in labkit goes through :func:`blocks_needed`, so the rule "a partly filled
block is a whole block" is written once. :func:`extra_blocks` is what the scheduler asks of the pool
before it gives a request more tokens (chapter 05): the new blocks, a private copy of a shared tail
(copy-on-write, chapter 04), and cached blocks a prefix hit takes back from the free queue. This
module counts; it holds no state (``labkit.memory.paging`` and ``labkit.memory.prefix`` do), and the
copy-on-write test itself, ``tail_is_shared``, sits beside the block table in ``labkit.memory.paging``.
"""

from __future__ import annotations

import numpy as np
import torch

from ..checks import check_flag, check_int


def blocks_needed(num_tokens, block_size: int):
    """Blocks that hold ``num_tokens`` tokens: ceil(num_tokens / block_size).

    ``num_tokens``: an int >= 0, or an integer numpy array or torch tensor of token counts (each >= 0),
    which gives one count per element.
    """
    if type(num_tokens) is int and type(block_size) is int and num_tokens >= 0 and block_size >= 1:
        return -(-num_tokens // block_size)  # the common case, checked in one line
    if not isinstance(num_tokens, (np.ndarray, torch.Tensor)):
        check_int("num_tokens", num_tokens, 0)
    elif (num_tokens.dtype.kind not in "iu" if isinstance(num_tokens, np.ndarray) else
          num_tokens.dtype.is_floating_point or num_tokens.dtype.is_complex or num_tokens.dtype == torch.bool):
        raise ValueError(f"num_tokens must hold integer token counts, got dtype {num_tokens.dtype}")
    elif len(num_tokens.reshape(-1)) and int(num_tokens.min()) < 0:
        raise ValueError(f"num_tokens must be >= 0, got a count of {int(num_tokens.min())}")
    check_int("block_size", block_size, 1)
    return -(-num_tokens // block_size)


def extra_blocks(num_computed_tokens: int, num_blocks_held: int, tokens: int, block_size: int, *,
                 shared_tail: bool = False, revived_blocks: int = 0) -> int:
    """Free blocks that computing ``tokens`` more tokens of a request takes from the pool.

    * **new blocks** for the slots: positions ``[num_computed_tokens, num_computed_tokens
      + tokens)`` need ``blocks_needed(num_computed_tokens + tokens)`` blocks, of which the
      request holds ``num_blocks_held``;
    * **copy-on-write**: +1 when the next token lands in a partly filled tail block that
      another request also holds (``shared_tail``): it gets a private copy first;
    * **revived blocks**: a prefix hit on cached blocks that no one holds takes them out of
      the free queue too.
    """
    check_int("num_computed_tokens", num_computed_tokens, 0)
    check_int("num_blocks_held", num_blocks_held, 0)
    check_int("tokens", tokens, 0)
    check_int("block_size", block_size, 1)
    check_flag("shared_tail", shared_tail)
    check_int("revived_blocks", revived_blocks, 0)
    return _extra_blocks(num_computed_tokens, num_blocks_held, tokens, block_size, shared_tail, revived_blocks)


def _extra_blocks(computed: int, held: int, tokens: int, block_size: int, shared_tail: bool = False,
                  revived: int = 0) -> int:
    """``extra_blocks`` without the checks: the one place labkit counts new blocks plus a copy."""
    if tokens == 0:
        return 0
    new = max(0, blocks_needed(computed + tokens, block_size) - held)
    return new + (1 if shared_tail and computed % block_size else 0) + revived
