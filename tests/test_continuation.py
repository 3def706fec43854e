"""Calibration text the receiver writes itself (`budget.continuation`, src/forward.py greedy_continuation): the
continuation is the target's greedy choice token by token (checked against full forwards without a cache), the
head of each window is kept, the ids stay in the pair's shared vocabulary, and the calibration reads the rewritten
windows under a traces key of their own."""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import src.pipeline
from src.forward import greedy_continuation
from tests.conftest import calibration_ids, tiny

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared/data"


@pytest.fixture(scope="module")
def model():
    return tiny("qwen2", seed=1).eval()


def reference(model, ids: torch.Tensor, keep: int, vocab: int) -> torch.Tensor:
    """Greedy decoding by full forwards over the growing text, one row at a time (no cache, no batching)."""
    rows = []
    for row in ids:
        text = row[:keep].tolist()
        while len(text) < ids.shape[1]:
            logits = model(torch.tensor([text])).logits[0, -1, :vocab]  # [vocab]
            text.append(int(logits.argmax()))
        rows.append(text)
    return torch.tensor(rows)


def test_the_continuation_is_the_models_greedy_choice(model):
    ids = calibration_ids(3, 20, seed=2)  # [3, 20]
    out = greedy_continuation(model, ids, keep=12, vocab_size=96, batch_size=2)  # two batches: 2 + 1 rows
    assert torch.equal(out[:, :12], ids[:, :12]) and not torch.equal(out, ids)
    assert torch.equal(out, reference(model, ids, 12, 96))
    assert torch.equal(out, greedy_continuation(model, ids, 12, 96, batch_size=64))


def test_ids_stay_in_the_shared_vocabulary_and_bad_keeps_are_refused(model):
    ids = calibration_ids(2, 16, seed=4)
    assert int(greedy_continuation(model, ids, 4, vocab_size=7)[:, 4:].max()) < 7
    assert torch.equal(greedy_continuation(model, ids, 16, 96), ids)  # nothing to write
    for keep in (0, 17):
        with pytest.raises(ValueError, match="keeps 1..16 tokens"):
            greedy_continuation(model, ids, keep, 96)


def _cfg(home: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(
            "run",
            overrides=[
                f"paths.home={home}",
                f"paths.data={DATA}",
                "+experiment=quickstart",
                "budget.sequences=4",
                "budget.seq_len=32",
                "budget.batch_size=4",
                *overrides,
            ],
        )


def test_calibration_reads_the_rewritten_windows_under_their_own_key(tmp_path, monkeypatch):
    read = []
    collect = src.pipeline.collect_traces
    monkeypatch.setattr(
        src.pipeline, "collect_traces", lambda s, t, ids, *a, **k: read.append(ids) or collect(s, t, ids, *a, **k)
    )
    plain_cfg, written_cfg = _cfg(tmp_path), _cfg(tmp_path, "budget.continuation=0.25")
    pair = src.pipeline.load(plain_cfg)
    _, plain_key = src.pipeline.calibration(plain_cfg, pair)
    _, written_key = src.pipeline.calibration(written_cfg, pair)
    plain, written = read
    assert plain_key != written_key
    assert torch.equal(written[:, :24], plain[:, :24]) and not torch.equal(written[:, 24:], plain[:, 24:])
    vocab = src.pipeline.vocab_size(pair)
    assert torch.equal(written, greedy_continuation(pair.target, plain, 24, vocab))
