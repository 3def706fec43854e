"""Mapper support (`src.support`) beyond tests/test_fit.py (which checks head_assignment for equal counts, GQA up and
down, non-dividing refusals, cyclic shifts with equal counts, and coefficient counts of fitted mappers):
gather_features against an index-by-index definition (layer, head, channel order; one target layer and a group),
cyclic shifts under GQA, the token K/V features and their broadcast, the gathered width = the width Eqs. 12–13
count for every support, and the block-PCA basis.
"""

import pytest
import torch

from src.support import (
    SUPPORTS,
    coefficient_count,
    gather_features,
    head_assignment,
    pca_basis,
    token_kv,
    token_width,
    with_token_kv,
)


def _tagged_rows(layers=3, heads=4, rows=5, dim=3) -> torch.Tensor:
    """rows[l, h, n, c] = 1000·l + 100·h + 10·n + c: every entry names where it came from. [L_s, H_s, n, d_s]"""
    layer, head, row, channel = torch.meshgrid(
        *(torch.arange(size) for size in (layers, heads, rows, dim)), indexing="ij"
    )
    return (1000 * layer + 100 * head + 10 * row + channel).float()


@pytest.mark.parametrize(("source_heads", "target_heads"), [(4, 2), (4, 4), (2, 4)])
@pytest.mark.parametrize("support", ["local", "full", "cyclic"])
def test_gather_features_orders_layer_head_channel(support, source_heads, target_heads):
    rows = _tagged_rows(heads=source_heads)
    head_index = head_assignment(support, source_heads, target_heads, shift=1)  # [H_t, f]
    layers = torch.tensor([2, 0])  # S_ℓ in the order given, not sorted
    features = gather_features(rows, layers, head_index)
    assert features.shape == (target_heads, 5, 2 * head_index.shape[1] * 3)  # [H_t, n, k·f·d_s]
    for t in range(target_heads):
        for n in range(5):
            expected = torch.cat([rows[j, g, n] for j in layers for g in head_index[t]])  # layer j, head g, channel
            assert torch.equal(features[t, n], expected)
    group = torch.tensor([[2, 0], [1, 1], [0, 2]])  # [g, k]: three target layers at once
    grouped = gather_features(rows, group, head_index)  # [g, H_t, n, k·f·d_s]
    assert torch.equal(grouped, torch.stack([gather_features(rows, layers_, head_index) for layers_ in group]))


def test_cyclic_shift_under_gqa():
    # H_t = 2·H_s: a(h) = (⌊h/2⌋ + c) mod H_s
    assert head_assignment("cyclic", 2, 4, shift=1)[:, 0].tolist() == [1, 1, 0, 0]
    # H_s = 2·H_t: the group's heads m·h … m·h+m−1, each shifted by c mod H_s
    assert head_assignment("cyclic", 4, 2, shift=1).tolist() == [[1, 2], [3, 0]]
    assert head_assignment("cyclic", 4, 2, shift=2).tolist() == [[2, 3], [0, 1]]  # the other group, whole


def test_token_kv_and_its_broadcast():
    heads, rows, dim = 2, 4, 3
    k0 = torch.arange(heads * rows * dim).float().reshape(heads, rows, dim)  # [H_t, n, d_t]
    v0 = -k0 - 1
    tokens = token_kv(k0, v0)  # [n, 2·H_t·d_t]
    assert tokens.shape == (rows, token_width(heads, dim)) == (rows, 2 * heads * dim)
    for n in range(rows):  # K of head 0, K of head 1, V of head 0, V of head 1
        assert torch.equal(tokens[n], torch.cat([k0[0, n], k0[1, n], v0[0, n], v0[1, n]]))
    features = torch.randn(3, 5, rows, 7, dtype=torch.float64)  # [g, H, n, p]
    widened = with_token_kv(features, tokens)
    assert widened.shape == (3, 5, rows, 7 + 12) and widened.dtype == torch.float64
    assert torch.equal(widened[..., :7], features)
    assert torch.equal(widened[..., 7:], tokens.double().expand(3, 5, rows, 12))  # every head, every layer
    assert with_token_kv(features, None) is features


@pytest.mark.parametrize("support", [s for s in SUPPORTS if s != "pca"])
@pytest.mark.parametrize(("source_heads", "target_heads"), [(2, 4), (4, 2), (2, 2)])
@pytest.mark.parametrize("tokens", [False, True])
def test_gathered_width_is_the_counted_width(support, source_heads, target_heads, tokens):
    """C(f) = 2·L_t·H_t·(k·f·d_s + q)·d_t (Eqs. 12–13) counts exactly the designs gather_features builds."""
    target_layers, k, d_s, d_t, rows = 3, 2, 3, 5, 4
    head_index = head_assignment(support, source_heads, target_heads)
    token_rows = torch.zeros(rows, token_width(target_heads, d_t)) if tokens else None
    features = gather_features(_tagged_rows(heads=source_heads, rows=rows), torch.tensor([0, 1]), head_index)
    design = with_token_kv(features, token_rows)  # [H_t, n, k·f·d_s + q]
    q = token_width(target_heads, d_t) if tokens else 0
    count = coefficient_count(target_layers, target_heads, k, head_index.shape[1], d_s, d_t, q)
    assert count == 2 * target_layers * target_heads * design.shape[-1] * d_t


def test_pca_basis_is_orthonormal_and_finds_the_planted_subspace():
    generator = torch.Generator().manual_seed(0)
    layers, heads, rows, dim, rank = 2, 3, 400, 4, 2
    lift = torch.linalg.qr(torch.randn(layers, heads * dim, rank, generator=generator, dtype=torch.float64))[0]
    latent = 5 * torch.randn(layers, rows, rank, generator=generator, dtype=torch.float64)
    blocks = latent @ lift.transpose(1, 2) + 3.0  # [L_s, n, H_s·d_s] in a rank-2 subspace, offset 3
    rows_ = blocks.unflatten(-1, (heads, dim)).permute(0, 2, 1, 3)  # [L_s, H_s, n, d_s]
    mean, basis = pca_basis(rows_, rank)
    torch.testing.assert_close(mean, blocks.mean(1))
    assert basis.shape == (layers, heads * dim, rank)
    torch.testing.assert_close(
        basis.transpose(1, 2) @ basis, torch.eye(rank, dtype=torch.float64).expand(layers, -1, -1)
    )
    projector = lambda b: b @ b.transpose(1, 2)
    torch.testing.assert_close(projector(basis), projector(lift), rtol=1e-8, atol=1e-8)  # the same subspace
