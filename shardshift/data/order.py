"""The order of an epoch's samples: a permutation of ``0 .. n-1`` drawn from ``(seed, epoch)`` and
computed one index at a time, in constant memory whatever ``n``.

It is a Feistel network on the smallest even number of bits ``2h`` with ``2**(2h) >= n``: the
index's high and low halves go through `ROUNDS` rounds of ``(l, r) -> (r, l ^ f_k(r))``, with
``f_k`` a 64-bit mix of ``r`` and the round key ``k`` cut to ``h`` bits. Each round is a bijection
of ``2h``-bit numbers, so the network is. A result at or beyond ``n`` goes through the network
again until it falls below ``n`` ("cycle walking", which keeps the map a bijection of
``0 .. n-1``); as ``2**(2h) < 4n``, an index walks fewer than four times on average. The round keys
come from BLAKE2b of ``(seed, epoch)``. Every function here takes numpy arrays of indices, so a
batch of a million windows costs a few vectorised passes.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np

ROUNDS = 6
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """A 64-bit finaliser (splitmix64's): every output bit depends on every input bit."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@functools.lru_cache(maxsize=64)
def _keys(seed: int, epoch: int) -> tuple[int, ...]:
    digest = hashlib.blake2b(f"shardshift-order/{seed}/{epoch}".encode(), digest_size=8 * ROUNDS).digest()
    return tuple(int.from_bytes(digest[8 * i: 8 * i + 8], "little") for i in range(ROUNDS))


def _half_bits(n: int) -> int:
    bits = max(2, (n - 1).bit_length())
    return (bits + 1) // 2


def _network(x: np.ndarray, keys: tuple[int, ...], half: int) -> np.ndarray:
    mask = np.uint64((1 << half) - 1)
    left, right = x >> np.uint64(half), x & mask
    for key in keys:
        left, right = right, left ^ (_mix(right ^ np.uint64(key)) & mask)
    return (left << np.uint64(half)) | right


def permute(indices, n: int, seed: int, epoch: int) -> np.ndarray:
    """Where the epoch's permutation of ``0 .. n-1`` sends each of `indices` (int64, same shape)."""
    x = np.asarray(indices, dtype=np.int64)
    if x.size and (x.min() < 0 or x.max() >= n):
        raise IndexError(f"indices must lie in [0, {n})")
    if n <= 1:
        return x.copy()
    keys, half = _keys(seed, epoch), _half_bits(n)
    out = _network(x.astype(np.uint64), keys, half)
    outside = out >= np.uint64(n)
    while outside.any():
        out[outside] = _network(out[outside], keys, half)
        outside = out >= np.uint64(n)
    return out.astype(np.int64)
