"""Mapped K/V are never an exact prefix hit: a per-block provenance key in vLLM's prefix cache.

vLLM keys a full block by a hash chained over the prompt (`hash_block_tokens(parent, tokens, extra_keys)`), and
commits a request's blocks to the prefix cache under those keys — blocks a connector loaded included. kvrelay
re-keys a request from its first mapped block on: that block's key is derived from its native key and
`("kvrelay", mapper id)`, and every later block chains on it (the request's own hasher, `update_block_hashes`).
So the blocks before the mapped span keep their native keys (a native sink still hits, and those blocks serve
other requests), the mapped blocks and everything computed after them ("mapped tokens, and tokens read after them")
live under keys no plain request produces — a plain request of the same prompt misses them and prefills — and a
later turn of the same conversation that names the same span (`continuation` params) reproduces the keys and hits
them. Chosen over `cache_salt`, which keys block 0 and therefore the whole chain: the sink could never hit the
receiver's native blocks. Touches the request's `block_hashes` list and `update_block_hashes` only (vLLM 0.26 and
0.32 alike); never patches vLLM.
"""

from __future__ import annotations

import hashlib


def provenance_key(mapper_id: str) -> bytes:
    return f"kvrelay\0{mapper_id}".encode()


def rekey(request, start: int, mapper_id: str, block_size: int) -> None:
    """Re-key `request` (a vLLM Request) from the block holding position `start` (a multiple of block_size) on. A
    request already re-keyed at that block or an earlier one is left alone (its chain carries a key from there on);
    one re-keyed at a later block is a ValueError."""
    if start % block_size:
        raise ValueError(f"a mapped span starts on a block boundary, not at {start} (block {block_size})")
    first = start // block_size
    hashes = request.block_hashes
    done = getattr(request, "_kvrelay_provenance", None)
    if done is not None and done[0] <= first:
        return
    if done is not None:
        raise ValueError(f"request {request.request_id} is already re-keyed from block {done[0]}, after {first}")
    if len(hashes) != request.num_tokens // block_size:
        raise ValueError(f"request {request.request_id}: {len(hashes)} block hashes for {request.num_tokens} tokens "
                         f"in blocks of {block_size} (hybrid hash granularity is not supported)")  # fmt: skip
    if first >= len(hashes):
        raise ValueError(f"request {request.request_id} has no full block at position {start} to re-key")
    tainted = hashlib.sha256(provenance_key(mapper_id) + b"\0" + hashes[first]).digest()
    del hashes[first:]  # the same list object: whatever holds it sees the new keys
    hashes.append(tainted)
    request.update_block_hashes()  # blocks after `first`, chained on the tainted key by the request's own hasher
    request._kvrelay_provenance = (first, mapper_id)
