"""The receiver engine on real weights (slow: not in the default suite; skipped unless the model is cached by
`python scripts/fetch_models.py qwen25coder_1p5b`): a prefill on the engine (sdpa's flash path) then a 32-token turn
(the turn-attention kernel, or its torch reference on CPU) give the logits one Hugging Face forward gives over the
same tokens — the check the tiny random families make, on the model the routed runs serve.

    python -m pytest -q -m slow tests/test_engine_real.py
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from src.fetch import RECIPES, kvrelay_home, model_dir
from src.runtime.engine import Engine

MODEL = model_dir(RECIPES["qwen25coder_1p5b"], kvrelay_home())
TEXT = (
    "A router hands a conversation from a small model to a large one. The large model must continue from the small "
    "model's cache instead of reading the whole history again, and it must give the answer it would have given. "
) * 8


@pytest.mark.slow
@pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason=f"no cached model at {MODEL}")
def test_engine_equals_hf_on_the_real_receiver():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="sdpa").to(device)
    ids = torch.tensor(AutoTokenizer.from_pretrained(MODEL)(TEXT)["input_ids"][:320])  # [T]
    history = ids.numel() - 32
    with torch.inference_mode():
        reference = model(ids[None].to(device)).logits[0]  # [T, V]
    engine = Engine(model.eval(), 512, graphs=False)
    prefilled = engine.forward(ids[:history], torch.arange(history))  # [1, V]: the last history token
    turn = engine.forward(ids[history:], torch.arange(history, ids.numel()))  # [1, V]: the turn's last token
    for got, want in ((prefilled[0], reference[history - 1]), (turn[0], reference[-1])):
        assert (got - want).abs().max() < 1e-3 and got.argmax() == want.argmax()
