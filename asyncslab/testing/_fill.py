"""What a synthetic tensor holds: a pure function of the spec's seed and the tensor's name.

Two fills: ``fill_random`` (torch's samplers, values shaped like real weights) and
``fill_pattern`` (one XOR pass, for multi-GB checkpoints where the samplers would be the
bottleneck). Both are keyed by :func:`tensor_key`, so every write of one spec is
byte-identical and a test can recompute any tensor instead of storing it. The layout (which
tensors, their shapes and shards) is ``_synthetic``'s.
"""

from __future__ import annotations

import hashlib
import math
from typing import Literal

import torch

__all__ = ["MCG_MARKER", "MUL1_MARKER", "Kind", "fill_pattern", "fill_random", "tensor_key"]

Kind = Literal["dense", "norm", "trellis", "scale", "mcg", "mul1"]

# Arbitrary but fixed marker values. They are not randomised so that a loader
# test can check it read the right bytes for the 4-byte marker tensors, which
# are too small to be distinguished reliably by random content.
MCG_MARKER = 0x4AFEF00D
MUL1_MARKER = 0x03DCD12D

# Odd 64-bit multipliers (golden ratio and a splitmix constant), as signed int64.
_K_WORD = 0x9E3779B97F4A7C15 - (1 << 64)
_K_BLOCK = 0xD1B54A32D192ED03 - (1 << 64)
_PATTERN_BLOCK = 1 << 16  # words; 512 KiB of int64 stays in cache while broadcasting
_pattern_base: torch.Tensor | None = None


def tensor_key(seed: int, name: str) -> int:
    """64-bit key from (seed, name): stable across processes and platforms, unlike hash()."""
    digest = hashlib.blake2b(f"{seed}\x00{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def fill_random(
    kind: Kind, shape: tuple[int, ...], key: int, dense_dtype: torch.dtype
) -> torch.Tensor:
    g = torch.Generator().manual_seed(key & 0x7FFFFFFFFFFFFFFF)
    if kind == "trellis":
        return torch.randint(-32768, 32768, shape, dtype=torch.int16, generator=g)
    # Sampled straight in the target dtype with mean/std applied by the sampler:
    # no float32 temporaries (fresh pages are costly) and no separate
    # multithreaded scaling pass (its OpenMP barrier stalls on a busy machine).
    if kind == "scale":
        return torch.normal(0.0, 1.0, shape, generator=g, dtype=torch.float16)
    if kind == "norm":
        return torch.normal(1.0, 0.01, shape, generator=g, dtype=dense_dtype)
    return torch.normal(0.0, 0.02, shape, generator=g, dtype=dense_dtype)


def fill_pattern(dtype: torch.dtype, shape: tuple[int, ...], key: int) -> torch.Tensor:
    """Cheap per-tensor-distinct bytes for multi-GB checkpoints.

    Word j of block i is ``(j * K_WORD) ^ (i * K_BLOCK) ^ key``: one broadcast
    XOR pass (its cost is the page faults of the output), distinct per tensor via the key
    and per block via the block term, so an offset error of a whole block is
    still visible in a byte-exact comparison. Bytes are reinterpreted as the
    target dtype, so float tensors may hold any bit pattern, NaNs included.
    """
    global _pattern_base
    if _pattern_base is None:
        _pattern_base = torch.arange(_PATTERN_BLOCK, dtype=torch.int64) * _K_WORD
    nbytes = math.prod(shape) * dtype.itemsize
    word_dtype = next(
        d for d in (torch.int64, torch.int32, torch.int16, torch.uint8) if nbytes % d.itemsize == 0
    )
    n_words = nbytes // word_dtype.itemsize
    base = _pattern_base.view(word_dtype)
    signed_key = key - (1 << 64) if key >= 1 << 63 else key
    key_t = torch.tensor(signed_key, dtype=torch.int64)
    if word_dtype is not torch.int64:
        key_t = key_t.reshape(1).view(word_dtype)[0]
    out = torch.empty(n_words, dtype=word_dtype)
    block = base.numel()
    n_full, rem = divmod(n_words, block)
    if n_full:
        block_keys = (torch.arange(n_full, dtype=torch.int64) * _K_BLOCK).view(-1, 1)
        if word_dtype is not torch.int64:
            block_keys = block_keys.view(word_dtype)[:, :1]
        torch.bitwise_xor(base, block_keys ^ key_t, out=out[: n_full * block].view(n_full, block))
    if rem:
        torch.bitwise_xor(base[:rem], key_t, out=out[n_full * block :])
    return out.view(dtype).reshape(shape)
