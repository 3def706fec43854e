"""Generation on one model's cache for a router session (`Session.generate`, src/runtime/session.py): HF `generate`
(greedy unless the caller says otherwise, one sequence) on a DynamicCache reader, or greedy decoding by one-token
forwards on a static engine reader — each restricted to the ids every model of the session reads — and the checks of
generate's arguments, made before anything changes. An engine reader refuses generate's keyword arguments and
generation-config settings a greedy argmax does not reproduce (`GREEDY_NEUTRAL`).
"""

from __future__ import annotations

from dataclasses import replace
from numbers import Integral

import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList, PreTrainedModel

from src.runtime.reader import Reader, Segment, model_device

RESERVED = ("input_ids", "inputs", "attention_mask", "past_key_values")  # generate's own: not a caller's kwargs
GREEDY_NEUTRAL = frozenset({  # generation-config fields an engine reader's greedy argmax honours or need not read
    "bos_token_id", "eos_token_id", "pad_token_id", "do_sample", "temperature", "top_p", "top_k", "min_p",
    "typical_p", "num_beams", "num_return_sequences", "max_length", "max_new_tokens", "use_cache",
    "output_attentions", "output_hidden_states", "output_scores", "output_logits", "return_dict_in_generate",
    "_from_model_config", "transformers_version",
})  # fmt: skip


class Vocabulary(LogitsProcessor):
    """Generation restricted to the first `size` ids: those every model of the session can read."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores.index_fill(-1, torch.arange(self.size, scores.shape[-1], device=scores.device), float("-inf"))


def check_generation(max_new_tokens: object, kwargs: dict) -> None:
    """A ValueError for generate arguments a session cannot take (no new token, another batch, its own inputs)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, Integral) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer ≥ 1, not {max_new_tokens!r}")
    if reserved := sorted(set(kwargs) & set(RESERVED)):
        raise ValueError(f"generate sets {reserved} itself from the session's conversation and cache")
    for name in ("num_beams", "num_return_sequences"):
        if kwargs.get(name, 1) != 1:
            raise ValueError(f"a session holds one conversation: {name} must be 1, not {kwargs[name]!r}")


def check_engine_generation(name: str, model: PreTrainedModel, kwargs: dict) -> None:
    """A ValueError for what an engine reader's greedy decoding does not apply: any keyword argument, and a generation
    config setting outside `GREEDY_NEUTRAL` (e.g. a repetition penalty)."""
    if kwargs:
        raise ValueError(f"an engine reader decodes greedily: generate takes no {sorted(kwargs)}")
    if unknown := sorted(set(model.generation_config.to_diff_dict()) - GREEDY_NEUTRAL):
        raise ValueError(f"{name!r}'s generation config sets {unknown}, which the engine's greedy argmax "
                         "does not apply")  # fmt: skip


def engine_decode(reader: Reader, turn: torch.Tensor, max_new_tokens: int, vocab: int) -> torch.Tensor:
    """Greedy decoding on the engine: the turn read, then one-token forwards, each token the argmax over the first
    `vocab` ids (those every model reads); stops after max_new_tokens or an eos id (kept). Returns the generated ids
    [G], every one read (the cache covers them all)."""
    logits = reader.read(turn) if turn.numel() else reader.logits  # [1, V]
    eos = reader.model.generation_config.eos_token_id
    stop = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    new = []
    for _ in range(max_new_tokens):
        token = logits[0, :vocab].argmax().reshape(1).cpu()  # [1]
        new.append(token)
        logits = reader.read(token)
        if int(token) in stop:
            break
    return torch.cat(new)  # [G]


def hf_generate(
    reader: Reader, conversation: torch.Tensor, turn: torch.Tensor, max_new_tokens: int, vocab: int, kwargs: dict
) -> torch.Tensor:
    """HF `generate` on the reader's DynamicCache after the conversation [T] it holds and the turn [N]: greedy, one
    sequence, unless kwargs say otherwise; a head wider than `vocab` is kept to the first `vocab` ids. Returns the
    generated ids [G], every one read (the cache covers them all); a ValueError when it wrote none."""
    if turn.numel() == 0:  # HF reads at least one uncached token: re-read the last one (the crop is exact)
        turn = conversation[-1:]
        conversation = conversation[:-1]
        reader.cache.crop(-1)
        last = reader.segments.pop()
        if last.end - 1 > last.start:
            reader.segments.append(replace(last, end=last.end - 1))
    if reader.cache is None:
        reader.cache = DynamicCache(config=reader.model.config)
    prompt = torch.cat([conversation, turn])[None].to(model_device(reader.model))  # [1, T + N]
    config = reader.model.generation_config
    settings = {"do_sample": False, "num_beams": 1, "num_return_sequences": 1, "max_new_tokens": max_new_tokens}
    if config.pad_token_id is None:
        eos = config.eos_token_id
        settings["pad_token_id"] = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    if reader.model.config.get_text_config().vocab_size > vocab:  # its head writes ids another cannot read
        settings["logits_processor"] = LogitsProcessorList([*kwargs.pop("logits_processor", []), Vocabulary(vocab)])
    out = reader.model.generate(
        prompt, attention_mask=torch.ones_like(prompt), past_key_values=reader.cache, **(settings | kwargs)
    )
    new = out[0, prompt.shape[1] :].cpu()  # [G]
    if new.numel() == 0:
        raise ValueError("generate wrote no token (its stopping settings): the session is unchanged")
    start = conversation.numel()
    reader.add(Segment(start, start + turn.numel() + new.numel() - 1, "native", reader.exact))
    reader.read(new[-1:])  # the cache covers the whole conversation again
    return new
