"""Tiny random-weight configs of every supported family (correctness only, never quality)."""

from pathlib import Path

import pytest
import torch
import yaml

from src.models import build_random_model

CONF = Path(__file__).resolve().parents[1] / "conf"

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
FAMILIES = {
    "llama": dict(TINY, model_type="llama", head_dim=16),
    "mistral": dict(TINY, model_type="mistral", head_dim=16, sliding_window=None),
    "qwen2": dict(TINY, model_type="qwen2"),
    "qwen3": dict(TINY, model_type="qwen3", head_dim=16),
}


def tiny(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    return build_random_model(dict(FAMILIES[family], **overrides), seed=seed)


@pytest.fixture(params=sorted(FAMILIES))
def family(request) -> str:
    return request.param


def budget_spec(name: str) -> dict:
    """conf/budget/<name>.yaml as it composes: over the budgets its defaults list names (paper_2k: paper_mix)."""
    spec = yaml.safe_load((CONF / "budget" / f"{name}.yaml").read_text())
    composed = {}
    for entry in spec.pop("defaults", []):
        composed |= budget_spec(entry) if entry != "_self_" else {}
    return composed | spec


def calibration_ids(sequences: int, length: int, vocab: int = 96, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (sequences, length), generator=generator)


class CountingTransfer:
    """Delegates to a KVTransfer and counts the handoffs."""

    def __init__(self, transfer):
        self.transfer, self.source, self.target, self.calls = transfer, transfer.source, transfer.target, 0

    def __call__(self, cache, **kwargs):
        self.calls += 1
        return self.transfer(cache, **kwargs)

    def into(self, out, cache, **kwargs):
        self.calls += 1
        return self.transfer.into(out, cache, **kwargs)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models on a shared 2-core machine: one intra-op thread is many times faster than an oversubscribed two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
