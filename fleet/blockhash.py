"""vLLM's prefix-cache block hashes, computed from token ids (for routers calling ``/route``).

Contract: :func:`block_hashes` returns, for a prompt's token ids, the hashes vLLM (V1, 0.9+)
gives its full blocks, in chain order, as the 32-byte digests vLLM keeps internally;
:func:`block_keys` folds them to the 64-bit keys KV events carry by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``: the digest's low 64 bits, big-endian) and that
``/route`` takes as ``block_hashes``. Only full blocks are hashed: a trailing partial block is
never cached by vLLM, so it has no hash.

The chain (``vllm/v1/core/kv_cache_utils.py``, ``hash_block_tokens``)::

    h_0 = H((NONE_HASH, tuple(tokens[0:B]), extra_keys_0))
    h_i = H((h_{i-1}, tuple(tokens[i*B:(i+1)*B]), extra_keys_i))
    NONE_HASH = H(seed), seed = $PYTHONHASHSEED if set, else "vllm-none-hash"

with ``H`` the engine's ``--prefix-caching-hash-algo``: ``sha256`` (default:
``sha256(pickle.dumps(x, protocol=5))``) or ``sha256_cbor`` (``sha256(cbor2.dumps(x,
canonical=True))``, language-independent). The xxhash variants use a random per-process seed
unless PYTHONHASHSEED is set, so a router cannot reproduce them in general; they are not offered.

Extra keys are part of the hash, which is what keeps LoRA adapters and salted requests apart in
the index: a LoRA request's blocks carry ``("lora", name, path)`` on every block, a
``cache_salt`` adds ``("cache_salt", salt)`` on the first block only, in that order (vLLM's
``generate_block_hash_extra_keys``). Multimodal inputs are not covered here.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Iterator, Sequence
from typing import Any

import cbor2

ALGORITHMS = ("sha256", "sha256_cbor")
DEFAULT_SEED = "vllm-none-hash"
_U64 = (1 << 64) - 1


class BlockHashAlgorithmError(ValueError):
    """An algorithm this helper cannot reproduce (the message lists the ones it can)."""


def _sha256_pickle(value: Any) -> bytes:
    # protocol 5 is pickle.HIGHEST_PROTOCOL on every Python vLLM supports (3.9-3.13), and
    # vLLM pickles with HIGHEST_PROTOCOL: pinning it keeps the hashes equal on a newer Python.
    return hashlib.sha256(pickle.dumps(value, protocol=5)).digest()


def _sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def _hash_fn(algorithm: str) -> Any:
    if algorithm == "sha256":
        return _sha256_pickle
    if algorithm == "sha256_cbor":
        return _sha256_cbor
    raise BlockHashAlgorithmError(
        f"prefix-caching hash algorithm {algorithm!r} cannot be reproduced by a router; "
        f"use one of {', '.join(ALGORITHMS)}"
    )


def none_hash(algorithm: str = "sha256", seed: str | None = None) -> bytes:
    """The root of every chain: ``H(seed)``; the seed is PYTHONHASHSEED when the engine has it
    set (pass the same value), else vLLM's fixed ``"vllm-none-hash"``."""
    return bytes(_hash_fn(algorithm)(DEFAULT_SEED if seed is None else seed))


def block_extra_keys(
    n_blocks: int,
    *,
    lora_name: str | None = None,
    lora_path: str | None = None,
    cache_salt: str | None = None,
) -> list[tuple[Any, ...] | None]:
    """The per-block extra keys vLLM hashes for a text request with these options."""
    out: list[tuple[Any, ...] | None] = []
    for i in range(n_blocks):
        keys: list[Any] = []
        if lora_name is not None:
            keys.append(("lora", lora_name, lora_path))
        if cache_salt and i == 0:
            keys.append(("cache_salt", cache_salt))
        out.append(tuple(keys) if keys else None)
    return out


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    algorithm: str = "sha256",
    seed: str | None = None,
    extra_keys: Sequence[tuple[Any, ...] | None] | None = None,
    lora_name: str | None = None,
    lora_path: str | None = None,
    cache_salt: str | None = None,
) -> list[bytes]:
    """The 32-byte digests of the prompt's full blocks, first block first.

    ``extra_keys``: one entry per full block, as vLLM hashes them; by default they are built
    from ``lora_name``/``lora_path``/``cache_salt`` (:func:`block_extra_keys`).
    ``seed``: the engine's PYTHONHASHSEED, when it has one.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, not {block_size}")
    hash_fn = _hash_fn(algorithm)
    n_blocks = len(token_ids) // block_size
    if extra_keys is None:
        extra_keys = block_extra_keys(
            n_blocks, lora_name=lora_name, lora_path=lora_path, cache_salt=cache_salt
        )
    elif len(extra_keys) < n_blocks:
        raise ValueError(f"extra_keys has {len(extra_keys)} entries for {n_blocks} full blocks")
    return list(_chain(token_ids, block_size, hash_fn, extra_keys, n_blocks, algorithm, seed))


def block_hash_chain(
    token_ids: Sequence[int], block_size: int, *, algorithm: str = "sha256", seed: str | None = None
) -> Iterator[bytes]:
    """:func:`block_hashes` one digest at a time (no extra keys), so that a caller on an event
    loop can hash a long prompt in slices, letting other work run between them."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, not {block_size}")
    n_blocks = len(token_ids) // block_size
    return _chain(
        token_ids, block_size, _hash_fn(algorithm), [None] * n_blocks, n_blocks, algorithm, seed
    )


def _chain(
    token_ids: Sequence[int],
    block_size: int,
    hash_fn: Any,
    extra_keys: Sequence[tuple[Any, ...] | None],
    n_blocks: int,
    algorithm: str,
    seed: str | None,
) -> Iterator[bytes]:
    parent = none_hash(algorithm, seed if seed is not None else os.environ.get("PYTHONHASHSEED"))
    for i in range(n_blocks):
        # int(): token ids of another integer type (numpy's) would pickle differently
        block = tuple(map(int, token_ids[i * block_size : (i + 1) * block_size]))
        parent = bytes(hash_fn((parent, block, extra_keys[i])))
        yield parent


def block_key(digest: bytes) -> int:
    """The 64-bit key of a digest, as vLLM's int-hash KV events carry it."""
    return int.from_bytes(digest, "big") & _U64


def block_keys(token_ids: Sequence[int], block_size: int, **options: Any) -> list[int]:
    """:func:`block_hashes` folded to 64-bit keys: what ``/route`` takes as ``block_hashes``."""
    return [block_key(d) for d in block_hashes(token_ids, block_size, **options)]
