"""lm-eval (0.4.x) adapter: score lm-eval tasks with a native or transferred context cache.

`KVRelayLM` is registered as lm-eval model `kvrelay`. Requests are tokenized as lm-eval's `HFLM` does
(`TemplateLM`: trailing context spaces move onto the continuation, the pair is encoded whole and split, an
empty context becomes BOS/EOS); `loglikelihood` groups requests by context so each context is prefilled — and
in `transfer` mode mapped, with the levers' target work native — once, with all its continuations read in one
batch (`src.eval.scoring`). Build it in Python from a loaded pair, `KVRelayLM(pair, mode, transfer, levers)`,
or from lm-eval's model_args (`KVRelayLM.from_model_args`, what `create_from_arg_string/obj` call).

Usage from lm-eval's command line. lm-eval 0.4.13 finds models only in its own registry and loads no plugins
(a bare `lm_eval --model kvrelay` says "no model for this name found"), so the command is lm-eval's own CLI
run by this module (`main`), which registers `kvrelay` first; every argument is lm-eval's (`--include_path`
for local task YAMLs, `--output_path`, `--log_samples`, `--limit`, …):

    python -m src.eval.harness --model kvrelay \
        --model_args source=/models/small,target=/models/large,mapper=/mappers/run1,mode=transfer,native_sink=4 \
        --tasks arc_easy --device cuda --output_path results/

`source`, `target`: local Hugging Face directories (weights and the shared tokenizer; the pair is checked),
`mapper`: a saved artifact (src/artifact.py), verified against both models' fingerprints and the tokenizer
hash — required by `mode=transfer` (the default), optional in `native_source` / `native_target` (the
reference rows). The levers (`native_sink`, `hold_back`, `native_layers`, … — the fields of
`src.runtime.plan.Levers`) apply to `transfer`. `dtype`, `compute_dtype`, `apply_backend`, `attn_implementation`,
`allow_sliding_window` and `device` default to the `pair:` block of conf/run.yaml; a `device` in model_args
wins over lm-eval's `--device` (whose CLI default is cuda:0); a CUDA device without CUDA falls back to the
CPU with a warning, as HFLM does.
`--batch_size` is accepted and changes nothing: each context is one forward with all its continuations.
In Python, `lm_eval.simple_evaluate(model="kvrelay", model_args="source=…,target=…,mapper=…")` after
`import src.eval.harness` does the same.

lm-eval is optional (the GPU image lacks it): without it this module imports, and `KVRelayLM` is absent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import torch
from omegaconf import OmegaConf
from tqdm import tqdm
from transformers import PreTrainedModel

from src.apply import KVTransfer
from src.artifact import load_mapper
from src.eval.scoring import MODES, check_mode, choice_loglikelihoods, context_cache, greedy_decode, reading_model
from src.models import Pair, fingerprint, load_pair
from src.runtime.plan import NO_LEVERS, Levers

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
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string

    LM_EVAL_AVAILABLE = True
except ModuleNotFoundError:
    LM_EVAL_AVAILABLE = False

log = logging.getLogger(__name__)

RUN_CONFIG = Path(__file__).parents[2] / "conf" / "run.yaml"  # its `pair:` block: the pair options' defaults
PAIR_OPTIONS = ("dtype", "compute_dtype", "apply_backend", "attn_implementation", "allow_sliding_window", "device")
LEVER_OPTIONS = tuple(field.name for field in fields(Levers))
LM_EVAL_OPTIONS = ("batch_size", "max_batch_size")  # lm-eval passes them to every model; batching is per context


def _torch_dtype(name: str, option: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{option}={name!r} is not a torch dtype (e.g. float32, bfloat16, float16)")
    return dtype


def _device(name: str) -> str:
    """The device asked for; a CUDA device without CUDA (lm-eval's default --device is cuda:0) → the CPU."""
    if name.startswith("cuda") and not torch.cuda.is_available():
        log.warning("kvrelay: device %s asked for but CUDA is not available; using the CPU", name)
        return "cpu"
    return name


def _levers(args: dict) -> Levers:
    """The lever fields named in args, each cast to its field's type (model_args arrive as str/int/float)."""
    chosen = {}
    for field in fields(Levers):
        if field.name in args:
            kind = type(field.default)
            try:
                chosen[field.name] = kind(args[field.name])
            except (TypeError, ValueError) as error:
                raise ValueError(f"{field.name}={args[field.name]!r}: expected {kind.__name__}") from error
    return Levers(**chosen)


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

        def __init__(self, pair: Pair, mode: str, transfer: KVTransfer | None = None, levers: Levers = NO_LEVERS):
            super().__init__()
            if pair.tokenizer is None:
                raise ValueError("lm-eval scores text: the pair needs a tokenizer (weights='real')")
            check_mode(mode, pair, transfer)
            if levers and mode != "transfer":
                raise ValueError(f"levers keep target work native around a mapped prefix: mode {mode!r} maps none")
            self.pair, self.mode, self.transfer, self.levers = pair, mode, transfer, levers
            self.tokenizer = pair.tokenizer
            self.model = reading_model(mode, pair)
            self._device = next(self.model.parameters()).device

        @classmethod
        def from_model_args(cls, args: dict) -> KVRelayLM:
            """Load the pair (`source`, `target`: local HF directories), verify and bind the `mapper` artifact,
            and read `mode` and the levers (module docstring)."""
            accepted = ("source", "target", "mapper", "mode", *PAIR_OPTIONS, *LEVER_OPTIONS, *LM_EVAL_OPTIONS)
            unknown = sorted(set(args) - set(accepted))
            if unknown:
                raise ValueError(f"unknown kvrelay model_args {unknown}; accepted: {', '.join(accepted)}")
            missing = [name for name in ("source", "target") if args.get(name) is None]
            if missing:
                raise ValueError(f"kvrelay model_args need {' and '.join(f'{name}=PATH' for name in missing)}")
            mode = args.get("mode", "transfer")
            if mode not in MODES:
                raise ValueError(f"kvrelay mode must be one of {', '.join(MODES)}, not {mode!r}")
            if mode == "transfer" and args.get("mapper") is None:
                raise ValueError("kvrelay mode=transfer needs mapper=PATH (a saved mapper artifact)")
            levers = _levers(args)  # refused before any model loads
            options = OmegaConf.to_container(OmegaConf.load(RUN_CONFIG).pair) | {
                name: args[name] for name in PAIR_OPTIONS if args.get(name) is not None
            }
            pair = load_pair(
                {"path": str(args["source"])},
                {"path": str(args["target"])},
                weights="real",
                dtype=_torch_dtype(options["dtype"], "dtype"),
                device=_device(str(options["device"])),
                allow_sliding_window=bool(options["allow_sliding_window"]),
                attn_implementation=options["attn_implementation"],
            )
            transfer = None
            if args.get("mapper") is not None:
                mapper = load_mapper(
                    str(args["mapper"]), fingerprint(pair.source), fingerprint(pair.target), pair.tokenizer_hash
                )
                compute = _torch_dtype(options["compute_dtype"], "compute_dtype")
                transfer = KVTransfer(
                    mapper, pair.source, pair.target, pair.tokenizer_hash, compute, options["apply_backend"]
                )
            return cls(pair, mode, transfer, levers)

        @classmethod
        def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> KVRelayLM:
            return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

        @classmethod
        def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> KVRelayLM:
            """model_args over lm-eval's own settings (`batch_size`, `max_batch_size`, `device`)."""
            general = {name: value for name, value in (additional_config or {}).items() if value is not None}
            return cls.from_model_args(general | dict(arg_dict))

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
                    self.mode, self.pair, torch.tensor(context), continuations, self.transfer, self.levers
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
                cache = context_cache(self.mode, self.pair, context_ids, self.transfer, self.levers)
                stop = stop_rule(self.tokenizer, until, self.model)
                tokens = greedy_decode(self.model, cache, int(context_ids[-1]), max_gen_toks, stop)
                text = postprocess_generated_text(self.tokenizer.decode(tokens, skip_special_tokens=True), until, None)
                outputs.append(text)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            return outputs


def main() -> None:
    """lm-eval's own CLI (same arguments) with `kvrelay` registered: lm-eval 0.4.13 loads no model plugins."""
    if not LM_EVAL_AVAILABLE:
        raise SystemExit("lm-eval is not installed: pip install -e '.[eval]'")
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":  # python -m src.eval.harness --model kvrelay --model_args … --tasks …
    main()
