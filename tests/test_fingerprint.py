"""Model identity cannot go stale (issue 11): `fingerprint` notices every way weights can be swapped in place after
a first fingerprint — `load_state_dict(..., assign=True)`, `p.data = …`, `p.data.copy_(…)`, writes through a
numpy view (the last two bypass the parameter's version counter) — and then equals the fingerprint of a fresh
model holding the new weights; `content_checksum` (the per-call guard of the cached sha256) is checked against a
pure-Python reference."""

import pytest
import torch
from conftest import tiny
from exact_pair import exact_pair

import src.models
from src.apply import KVTransfer
from src.maps import TransferError
from src.models import CHECKSUM_WORDS, content_checksum, fingerprint


def _weight(model) -> torch.nn.Parameter:
    return model.model.layers[1].self_attn.v_proj.weight


def _swap_assign(model, donor):
    model.load_state_dict(donor.state_dict(), assign=True)


def _swap_data(model, donor):
    for name, p in model.named_parameters():
        p.data = donor.get_parameter(name).detach().clone()


def _swap_copy(model, donor):
    for name, p in model.named_parameters():
        p.data.copy_(donor.get_parameter(name))


def _swap_numpy(model, donor):
    for name, p in model.named_parameters():
        p.detach().numpy()[...] = donor.get_parameter(name).detach().numpy()


def _swap_load(model, donor):
    model.load_state_dict(donor.state_dict())


SWAPS = {"assign": _swap_assign, "data": _swap_data, "data_copy": _swap_copy, "numpy": _swap_numpy, "load": _swap_load}


@pytest.mark.parametrize("kind", sorted(SWAPS))
def test_every_in_place_weight_swap_changes_the_fingerprint(kind):
    model, donor = tiny("llama", seed=0), tiny("llama", seed=1)
    before = fingerprint(model)
    assert fingerprint(donor) != before
    version = _weight(model)._version
    SWAPS[kind](model, donor)
    if kind in ("data_copy", "numpy"):
        assert _weight(model)._version == version  # invisible to version counters
    assert fingerprint(model) == fingerprint(tiny("llama", seed=1))  # the new weights' identity, not a stale one
    SWAPS[kind](model, tiny("llama", seed=0))
    assert fingerprint(model) == before  # and back


@pytest.mark.parametrize("kind", ["data_copy", "numpy"])
def test_one_element_edit_behind_the_version_counter(kind):
    model = tiny("llama").to(torch.bfloat16)
    before = fingerprint(model)
    weight = _weight(model)
    if kind == "data_copy":
        edited = weight.detach().clone()
        edited.view(torch.int16)[3, 5] ^= 1  # one bit of one bf16 element
        weight.data.copy_(edited)
    else:
        weight.detach().view(torch.int16).numpy()[3, 5] ^= 1
    assert fingerprint(model) != before


def test_permuted_rows_change_the_fingerprint():
    model = tiny("qwen2")
    before = fingerprint(model)
    weight = _weight(model)
    weight.data.copy_(weight.data.flip(0))  # same multiset of values, other positions
    assert fingerprint(model) != before


def test_identical_weights_swapped_in_keep_the_fingerprint_and_the_cache(monkeypatch):
    model = tiny("mistral")
    before = fingerprint(model)
    calls = []
    full_hash = src.models.weight_hash
    monkeypatch.setattr(src.models, "weight_hash", lambda m: calls.append(1) or full_hash(m))
    _swap_assign(model, tiny("mistral"))  # new tensors, same bytes
    assert fingerprint(model) == before and fingerprint(model) == before
    assert calls == []  # the sha256 was reused: only the checksums were read
    with torch.no_grad():
        _weight(model)[0, 0] += 1
    assert fingerprint(model) != before and calls == [1]


def test_dtype_change_changes_the_fingerprint():
    model = tiny("llama")
    before = fingerprint(model)
    assert fingerprint(model.to(torch.bfloat16)) != before


def test_swapped_target_weights_refuse_the_old_mapper():
    """The issue's failure: a mapper fitted for other weights must not bind after an in-place swap."""
    source, target, token_hash, exact, _ = exact_pair("llama")
    KVTransfer(exact, source, target, token_hash)
    with torch.no_grad():
        _weight(target).data.copy_(_weight(target).data * 1.5)
    with pytest.raises(TransferError, match="target fingerprint"):
        KVTransfer(exact, source, target, token_hash)


def _reference_checksum(tensor: torch.Tensor) -> int:
    """Σᵢⱼ xᵢⱼ·rⱼ·sᵢ mod 2³² in Python integers over the zero-padded int32 words [R, C] of the tensor's bytes."""
    data = bytes(tensor.contiguous().reshape(-1).view(torch.uint8).tolist())
    data += bytes(-len(data) % (4 * CHECKSUM_WORDS))
    words = [int.from_bytes(data[i : i + 4], "little", signed=True) for i in range(0, len(data), 4)]
    r = src.models._odd_words(CHECKSUM_WORDS, 0, torch.device("cpu")).tolist()
    rows = [words[i : i + CHECKSUM_WORDS] for i in range(0, len(words), CHECKSUM_WORDS)]
    s = src.models._odd_words(1 << max(len(rows) - 1, 0).bit_length(), 1, torch.device("cpu")).tolist()
    total = sum(sum(x * w for x, w in zip(row, r, strict=True)) * s[i] for i, row in enumerate(rows))
    return (total + 2**31) % 2**32 - 2**31


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3, 2 * CHECKSUM_WORDS + 5, generator=torch.Generator().manual_seed(0)),  # full rows + a tail
        torch.randn(7, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),  # 14 bytes: tail only
        torch.arange(10, dtype=torch.bfloat16)[1:],  # odd storage offset in bytes: not int32-aligned
        torch.tensor([True, False, True]),
        torch.zeros(0),
        torch.tensor(2.5),
    ],
    ids=["rows_and_tail", "tail_only", "misaligned_view", "bool", "empty", "scalar"],
)
def test_content_checksum_matches_the_modular_reference(tensor):
    assert int(content_checksum(tensor)) == _reference_checksum(tensor)
    if tensor.numel():
        edited = tensor.clone().reshape(-1)
        edited.view(torch.uint8)[-1] ^= 0x80  # one bit of the last byte
        assert int(content_checksum(edited.reshape(tensor.shape))) != int(content_checksum(tensor))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_content_checksum_on_cuda_equals_the_cpu_branch():
    """The CUDA branch (blockwise product + int32 sum, no integer GEMV) wraps mod 2³² like the CPU GEMV."""
    generator = torch.Generator().manual_seed(2)
    for tensor in (torch.randn(5000, 3, generator=generator), torch.randn(4099, generator=generator).bfloat16()):
        assert int(content_checksum(tensor.cuda())) == int(content_checksum(tensor))
    model = tiny("llama", seed=0)
    assert fingerprint(model.cuda()) == fingerprint(tiny("llama", seed=0))  # device is in the probe, not the hash
