"""Mapped K/V are never an exact prefix hit: a per-block provenance key in vLLM's prefix cache.

vLLM keys a full block by a hash chained over the prompt (`hash_block_tokens(parent, tokens, extra_keys)`), and
commits a request's blocks to the prefix cache under those keys — blocks a connector loaded included. kvrelay
re-keys a request from its first mapped block on: that block's key is derived from its native key and
`("kvrelay", mapper id)`, and every later block chains on it (the request's own hasher, `update_block_hashes`).
So the blocks before the mapped span keep their native keys (a native sink still hits, and those blocks serve
other requests), the mapped blocks and everything computed after them ("mapped tokens, and tokens read after them")
live under keys no plain request produces — a plain request of the same prompt misses them and prefills — and a
later turn of the same conversation that names the same span (`continuation` params) reproduces the keys and hits
them. Chosen over `cache_salt` as the default, which keys block 0 and therefore the whole chain: the sink could
never hit the receiver's native blocks. Touches the request's `block_hashes` list and `update_block_hashes` only
(vLLM 0.26 and 0.32 alike); never patches vLLM.

Where the receiver holds none of the conversation natively — a router's handoff into a model that has not read it,
no sink — the whole chain may as well be keyed apart from block 0, and vLLM does that itself when the request carries
a provenance salt, `cache_salt = "kvrelay:<first export id>:<mapper id>"` (`provenance_salt`): its own hashing of the
request, as it arrives, already gives every block a key no plain request produces, and the connector skips the
re-key (`salted`) — one pass of vLLM's hash over the span fewer on the handoff's path (1.4 ms at 8K on the H100,
2026-12-06). The salt names the conversation's first handoff into this model, so two conversations never share
blocks through it, and a model's later requests in the conversation carry the same salt (the router keeps it), so
they hit what it computed and mapped. A request with any other salt (a tenant's own, say) is re-keyed as above, its
salt kept in block 0's key. Like `mapped` parameters, the salt is the conversation's key: a request that sends it
asks for that conversation's cache.

The keys after the tainted one must be vLLM's own chain — its hasher appends the keys of the blocks a request
decodes on the last one, and a later turn must reproduce those to hit them — so a re-key costs what vLLM's hasher
costs over the blocks from the first mapped one to the prompt's end: per block, a pickle and a hash of (parent key,
token ids, extra keys) (`prefix_caching_hash_algo`; about 1 µs of the ≈ 1.8 µs a block costs on a 2-core CPU), and
its per-block extra-key lookup and token-list slicing (the rest). Given the engine's hash function (`hash_fn`), a
request none of whose blocks carries extra keys — no multimodal features; no LoRA, prompt embeddings or other
request-wide key, asked of vLLM's own `generate_block_hash_extra_keys` — gets the same keys from vLLM's
`hash_block_tokens` in one loop over its token ids, without the lookup (the keys equal `update_block_hashes`'s bit
for bit: tests/test_vllm_parts.py); any other request goes through `update_block_hashes`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from typing import Any

from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, hash_block_tokens


def provenance_key(mapper_id: str) -> bytes:
    return f"kvrelay\0{mapper_id}".encode()


EXPORT_ID = "[0-9a-f]{32}"  # the connector's export ids (uuid4 hex), the salt's first part


def provenance_salt(export_id: str, mapper_id: str) -> str:
    """The `cache_salt` under which vLLM keys a receiver's request apart from block 0 (module docstring): the
    conversation's first handoff into this model (its export id, 32 hex digits) and the route's mapper id."""
    if not re.fullmatch(EXPORT_ID, export_id):
        raise ValueError(f"an export id is 32 hex digits, not {export_id!r}")
    return f"kvrelay:{export_id}:{mapper_id}"


_SALT = re.compile(f"kvrelay:{EXPORT_ID}:(.+)", re.DOTALL)


def salted(request, mapper_id: str) -> bool:
    """Whether vLLM already keys `request` (a vLLM Request) apart for this mapper: its `cache_salt` is a provenance
    salt naming it, so no re-key is needed."""
    match = _SALT.fullmatch(getattr(request, "cache_salt", None) or "")
    return match is not None and match.group(1) == mapper_id


def rekey(request, start: int, mapper_id: str, block_size: int, hash_fn: Callable[[Any], bytes] | None = None) -> None:
    """Re-key `request` (a vLLM Request) from the block holding position `start` (a multiple of block_size) on. A
    request already re-keyed at that block or an earlier one is left alone (its chain carries a key from there on);
    one re-keyed at a later block is re-keyed again from this one — a request preempted after its load whose native
    prefix blocks were evicted meanwhile resumes with a shorter hit, and its span is mapped from there (its keys
    before `start` are still native: the tainted block is derived from the native one). hash_fn: the engine's block
    hash function (vLLM's `get_hash_fn_by_name(prefix_caching_hash_algo)`), for the one-loop chain (module
    docstring); None: vLLM's hasher for every request."""
    if start % block_size:
        raise ValueError(f"a mapped span starts on a block boundary, not at {start} (block {block_size})")
    first = start // block_size
    hashes = request.block_hashes
    done = getattr(request, "_kvrelay_provenance", None)
    if done is not None and done[0] <= first:
        return
    full = request.num_tokens // block_size
    if len(hashes) != full:
        raise ValueError(f"request {request.request_id}: {len(hashes)} block hashes for {request.num_tokens} tokens "
                         f"in blocks of {block_size} (hybrid hash granularity is not supported)")  # fmt: skip
    if first >= len(hashes):
        raise ValueError(f"request {request.request_id} has no full block at position {start} to re-key")
    tainted = hashlib.sha256(provenance_key(mapper_id) + b"\0" + hashes[first]).digest()
    del hashes[first:]  # the same list object: whatever holds it sees the new keys
    hashes.append(tainted)
    if hash_fn is not None and _without_extra_keys(request, first + 1, full, block_size):
        hashes.extend(_chain(hash_fn, tainted, request.all_token_ids[(first + 1) * block_size : full * block_size],
                             block_size))  # fmt: skip
    else:
        request.update_block_hashes()  # blocks after `first`, chained on the tainted key by the request's own hasher
    request._kvrelay_provenance = (first, mapper_id)


def _without_extra_keys(request, begin: int, end: int, block_size: int) -> bool:
    """Whether vLLM keys blocks begin..end − 1 of `request` by their token ids alone (module docstring): no
    multimodal feature anywhere, no request-wide extra key on the first of them (True when there are none)."""
    if begin >= end:
        return True
    if request.mm_features:
        return False
    extra, _ = generate_block_hash_extra_keys(request, begin * block_size, (begin + 1) * block_size, 0)
    return extra is None


def _chain(hash_fn: Callable[[Any], bytes], parent: bytes, tokens: list[int], block_size: int) -> list[bytes]:
    """vLLM's keys of the whole blocks of `tokens` chained on `parent`, without extra keys."""
    keys = []
    for at in range(0, len(tokens), block_size):
        parent = hash_block_tokens(hash_fn, parent, tokens[at : at + block_size], None)
        keys.append(parent)
    return keys
