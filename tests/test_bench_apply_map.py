"""scripts/bench_apply_map.py's `triton_paged` path times the map as the vLLM connector's direct writer calls it: its
destinations are each target layer's own flash cache with the request's blocks shuffled, and its error columns read
the map back from those blocks. Here, on the torch path: what lands at the slots and is read back is what the map
gives, token for token — so a destination or reader that mixed blocks up would show as an error, not a time."""

import torch

from kernels.apply_map import map_cache, map_cache_ref
from src.rope import rope_cos_sin
from tests.test_record_scripts import _module


def test_the_paged_path_reads_back_what_the_map_stored_at_shuffled_blocks():
    bench = _module("bench_apply_map")
    source, target = (bench.qwen3_config(role) for role in bench.SHAPES["tiny"])
    mapper = bench.random_mapper(source, target, "local", 2, torch.float32, "cpu")
    seq = 40  # 3 blocks of 16, the last one partly
    rotary = [bench.Qwen3RotaryEmbedding(config) for config in (source, target)]
    tables = [t for r in rotary for t in rope_cos_sin(r, torch.arange(seq))]  # source cos, sin, target cos, sin
    shape = (1, source.num_key_value_heads, seq, source.head_dim)
    keys, values = (torch.randn(source.num_hidden_layers, *shape) for _ in range(2))  # [L_s, 1, H_s, T, d_s]
    halves, slots = bench.paged_destinations(target, seq, torch.float32, "cpu")
    assert len(set((slots // bench.BLOCK).tolist())) == 3 and not torch.equal(slots, torch.arange(seq))  # shuffled
    assert halves[0].base.stride(1) == 2 * target.head_dim  # NHD: a token's heads adjacent, as FlashAttention stores
    flags = torch.zeros(target.num_hidden_layers, dtype=torch.int32)
    common = (keys, values, mapper, *tables, "half", "half", torch.float32)
    map_cache(*common, nonfinite=flags, backend="torch", out=halves, slots=slots)
    read = bench.paged_output(halves, slots)  # [L_t, 1, H_t, T, d_t] each, as the error columns read it
    for got, want in zip(read, map_cache_ref(*common), strict=True):
        torch.testing.assert_close(got, want)
