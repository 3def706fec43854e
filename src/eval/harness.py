"""lm-eval (0.4.x) adapter: score lm-eval tasks with a native or transferred context cache.

`KVRelayLM(pair, mode, transfer)` is registered as lm-eval model `kvrelay` and is built in Python from an
already-loaded pair (models come from kvrelay's config, never from an lm-eval arg string), then handed to
`lm_eval.simple_evaluate(model=lm, ...)`. Requests are tokenized as lm-eval's `HFLM` does (`TemplateLM`:
trailing context spaces move onto the continuation, the pair is encoded whole and split, an empty context
becomes BOS/EOS); `loglikelihood` groups requests by context so each context is prefilled — and in
`transfer` mode mapped — once, with all its continuations read in one batch (`src.eval.scoring`).

lm-eval is optional (the GPU image lacks it): without it this module imports, and `KVRelayLM` is absent.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tqdm import tqdm
from transformers import PreTrainedModel

from src.apply import KVTransfer
from src.eval.scoring import check_mode, choice_loglikelihoods, context_cache, greedy_decode, reading_model
from src.models import Pair

try:
    from lm_eval.api.instance import Instance
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import (
        handle_stop_sequences,
        has_bos_prefix,
        normalize_gen_kwargs,
        postprocess_generated_text,
        resolve_max_length,
    )
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    LM_EVAL_AVAILABLE = True
except ModuleNotFoundError:
    LM_EVAL_AVAILABLE = False

CONSTRUCT_IN_PYTHON = (
    "the kvrelay lm-eval model cannot be built from model_args: kvrelay loads its pair from its own config. "
    "Construct it in Python — KVRelayLM(pair, mode, transfer) — and pass the instance to "
    "lm_eval.simple_evaluate(model=...)"
)


def stop_rule(tokenizer, until: list[str], model: PreTrainedModel) -> Callable[[list[int]], bool]:
    """Stop once the text holds a stop string or the last token is an EOS id of the model's generation config."""
    eos = model.generation_config.eos_token_id
    eos_ids = set() if eos is None else set(eos) if isinstance(eos, list) else {eos}
    return lambda tokens: tokens[-1] in eos_ids or any(stop in tokenizer.decode(tokens) for stop in until)


if LM_EVAL_AVAILABLE:

    @register_model("kvrelay")
    class KVRelayLM(TemplateLM):
        """lm-eval model reading every context through a native (`native_source`, `native_target`) or
        transferred (`transfer`: source prefill → KVTransfer → target) cache."""

        max_gen_toks = 256  # HFLM's default

        def __init__(self, pair: Pair, mode: str, transfer: KVTransfer | None = None):
            super().__init__()
            if pair.tokenizer is None:
                raise ValueError("lm-eval scores text: the pair needs a tokenizer (weights='real')")
            check_mode(mode, pair, transfer)
            self.pair, self.mode, self.transfer = pair, mode, transfer
            self.tokenizer = pair.tokenizer
            self.model = reading_model(mode, pair)
            self._device = next(self.model.parameters()).device

        @classmethod
        def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
            raise TypeError(CONSTRUCT_IN_PYTHON)

        @classmethod
        def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
            raise TypeError(CONSTRUCT_IN_PYTHON)

        @property
        def eot_token_id(self) -> int:
            return self.tokenizer.eos_token_id

        @property
        def prefix_token_id(self) -> int:
            bos = self.tokenizer.bos_token_id
            return self.eot_token_id if bos is None else bos

        @property
        def max_length(self) -> int:
            return resolve_max_length(self.model.config, self.tokenizer)

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
            """HFLM's encoding: the tokenizer's own special tokens, none when the string already starts with BOS."""
            if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
                add_special_tokens = False
            special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
            return self.tokenizer.encode(string, **special)

        def _fit_context(self, context: list[int], continuation: list[int]) -> tuple[int, ...]:
            """HFLM's left truncation: context + continuation keep at most max_length + 1 tokens."""
            if len(continuation) > self.max_length:
                raise ValueError(f"continuation of {len(continuation)} tokens exceeds max_length {self.max_length}")
            return tuple(context[-(self.max_length + 1 - len(continuation)) :])

        def _loglikelihood_tokens(
            self, requests: list[tuple[tuple[str, str], list[int], list[int]]], disable_tqdm: bool = False
        ) -> list[tuple[float, bool]]:
            groups: dict[tuple[int, ...], list[int]] = {}
            for index, (_, context, continuation) in enumerate(requests):
                groups.setdefault(self._fit_context(context, continuation), []).append(index)
            results: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
            for context, indices in tqdm(groups.items(), disable=disable_tqdm, desc="kvrelay loglikelihood"):
                continuations = [torch.tensor(requests[index][2]) for index in indices]
                scores = choice_loglikelihoods(
                    self.mode, self.pair, torch.tensor(context), continuations, self.transfer
                )
                for index, score in zip(indices, scores, strict=True):
                    results[index] = score
                    self.cache_hook.add_partial("loglikelihood", requests[index][0], score)
            return results

        def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
            """Perplexity (HFLM's disjoint rolling windows) scored natively by the reading model — the target,
            or the source in `native_source`: a whole document has no handed-off prefix, so nothing is mapped."""
            mode = "native_source" if self.mode == "native_source" else "native_target"
            totals = []
            for (string,) in tqdm([request.args for request in requests], disable=disable_tqdm):
                windows = get_rolling_token_windows(self.tok_encode(string), self.prefix_token_id, self.max_length, 1)
                total = sum(
                    choice_loglikelihoods(mode, self.pair, torch.tensor(context), [torch.tensor(continuation)])[0][0]
                    for context, continuation in map(make_disjoint_window, windows)
                )
                totals.append(total)
                self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            return totals

        def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
            """Greedy decoding from the (mapped) cache of the context until a stop string, an EOS id of the
            reading model's generation config, or max_gen_toks; the context keeps its last
            max_length − max_gen_toks tokens (HFLM)."""
            eos = self.tokenizer.decode(self.eot_token_id, skip_special_tokens=False)
            outputs = []
            for context, gen_kwargs in tqdm([request.args for request in requests], disable=disable_tqdm):
                kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
                if kwargs["do_sample"]:
                    raise ValueError("kvrelay decodes greedily: do_sample=True / temperature > 0 is not supported")
                until, max_gen_toks = handle_stop_sequences(kwargs["until"], eos=eos), kwargs["max_gen_toks"]
                context_ids = torch.tensor(self.tok_encode(context)[-(self.max_length - max_gen_toks) :])  # [T_c]
                cache = context_cache(self.mode, self.pair, context_ids, self.transfer)
                stop = stop_rule(self.tokenizer, until, self.model)
                tokens = greedy_decode(self.model, cache, int(context_ids[-1]), max_gen_toks, stop)
                text = postprocess_generated_text(self.tokenizer.decode(tokens, skip_special_tokens=True), until, None)
                outputs.append(text)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            return outputs
