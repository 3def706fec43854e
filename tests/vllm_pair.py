"""A tiny serving pair on disk for vLLM (correctness only, never quality): random-weight Qwen2 models saved with
`save_pretrained` beside one locally trained tokenizer (no hub), and two mappers into the large one.

    pair = serving_pair(tmp_path)   # small (2 layers, 1 KV head) → large (3 layers, 2 KV heads), head_dim 32
    pair.small, pair.large          # model directories (config, safetensors, tokenizer)
    pair.fitted, pair.identity      # mapper directories: small → large fitted by the project's own fit on random
                                    # calibration (Head-Local, k = 2); large → large identity (an exact pair)

vLLM's CPU backend needs head_size ≥ 32. The models are float32, and so are the fingerprints in the manifests.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from src.artifact import save_mapper
from src.fit import fit_transfer
from src.models import build_random_model, describe_kv, load_tokenizer, tokenizer_hash
from src.traces import collect_traces
from tests.conftest import calibration_ids
from tests.exact_pair import _mapper

VOCAB = 320
CALIBRATION = 64  # tokens per calibration sequence: the factor rule's unit
COMMON = dict(model_type="qwen2", vocab_size=VOCAB, max_position_embeddings=1024, tie_word_embeddings=False,
              initializer_range=0.1, eos_token_id=1, bos_token_id=1)  # fmt: skip
SMALL = dict(COMMON, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1)  # fmt: skip
LARGE = dict(COMMON, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2)  # fmt: skip


@dataclass(frozen=True)
class ServingPair:
    small: Path
    large: Path
    fitted: Path
    identity: Path
    tokenizer_hash: str


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on two sentences: ids up to VOCAB, no hub."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    text = ["the quick brown fox jumps over the lazy dog " * 20, "hello world, this is a tiny model for tests " * 20]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")  # fmt: skip


def serving_pair(root: Path) -> ServingPair:
    """Build and save the pair and its two mappers under `root` (module docstring)."""
    tokenizer = tiny_tokenizer()
    small = build_random_model(SMALL, seed=0)
    large = build_random_model(LARGE, seed=1)
    for name, model in (("small", small), ("large", large)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    token_hash = tokenizer_hash(load_tokenizer(root / "large"))  # as a server reads it back
    traces = collect_traces(small, large, calibration_ids(8, CALIBRATION, vocab=VOCAB, seed=3), stride=1, batch_size=8)
    fitted = fit_transfer(small, large, traces, token_hash, support="local", k=2, lam=1e-3)
    save_mapper(fitted, root / "fitted")
    kv = describe_kv(large)
    eye = torch.eye(kv.head_dim).expand(kv.num_layers, kv.num_kv_heads, kv.head_dim, kv.head_dim)  # [L, H, d, d]
    save_mapper(_mapper(large, large, token_hash, eye, eye, "identity"), root / "identity")
    return ServingPair(root / "small", root / "large", root / "fitted", root / "identity", token_hash)


CONNECTOR = dict(kv_connector="KVRelayConnector", kv_connector_module_path="src.serving.vllm_connector",
                 kv_role="kv_both", kv_load_failure_policy="recompute")  # fmt: skip
ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
}  # one OMP thread per engine, with or without a connector (docs/serving.md)


def engine(model: Path, extra: dict | None, **overrides):
    """A vLLM engine (CPU, float32, blocks of 32, eager, prefix caching, 64 MiB of KV cache) of the model directory,
    with the kvrelay connector set up by `extra` (its kv_connector_extra_config), or without a connector (None)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None if extra is None else KVTransferConfig(**CONNECTOR, kv_connector_extra_config=extra)
    settings = dict(dtype="float32", max_model_len=512, block_size=32, enforce_eager=True, enable_prefix_caching=True,
                    seed=0, kv_cache_memory_bytes=64 << 20)  # fmt: skip
    return LLM(model=str(model), kv_transfer_config=transfer, **(settings | overrides))


def paged_kv(worker, block_ids: list[int], tokens: int) -> bytes:
    """On a vLLM worker (`LLM.collective_rpc`): keys and values [L, H, tokens, d] of the request whose blocks are
    `block_ids`, read from every attention layer's paged cache — pickled (vLLM's RPC carries bytes)."""
    import pickle

    from vllm.model_executor.models.utils import extract_layer_index

    from src.serving.paged import layout_of, read_slots, slots_for

    context = worker.vllm_config.compilation_config.static_forward_context
    layers = [
        layer for _, layer in sorted((extract_layer_index(n), c) for n, c in context.items() if hasattr(c, "kv_cache"))
    ]
    slots = slots_for(block_ids, layers[0].kv_cache.shape[2], 0, tokens)
    pairs = [read_slots(layer.kv_cache, slots, layout_of(layer)) for layer in layers]  # ([T, H, d], [T, H, d])
    keys = torch.stack([k for k, _ in pairs]).transpose(1, 2)  # [L, H, T, d]
    values = torch.stack([v for _, v in pairs]).transpose(1, 2)
    return pickle.dumps((keys.clone(), values.clone()))


def stacked_write_matches(worker, block_ids: list[int], tokens: int) -> bool:
    """On a vLLM worker (`LLM.collective_rpc`): whether paged_writer "stacked" (src/serving/paged.py) writes into the
    engine's own caches exactly what each layer's own writer writes — random K/V of positions 0..tokens − 1 of blocks
    `block_ids`, every cache compared whole; the caches are put back as they were. False where they do not stack."""
    from vllm.model_executor.models.utils import extract_layer_index

    from src.serving.paged import layout_of, slots_for, stack_layers, write_mapped

    context = worker.vllm_config.compilation_config.static_forward_context
    layers = [
        layer for _, layer in sorted((extract_layer_index(n), c) for n, c in context.items() if hasattr(c, "kv_cache"))
    ]
    stacked = stack_layers(layers)
    if stacked is None:
        return False
    kv = layers[0].kv_cache
    slots = slots_for(block_ids, kv.shape[2], 0, tokens)
    generator = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(len(layers), tokens, kv.shape[1], kv.shape[3] // 2, generator=generator).to(kv.dtype)
                    for _ in range(2))  # fmt: skip
    saved = [layer.kv_cache.clone() for layer in layers]
    written = []
    for plan in (None, (stacked, layout_of(layers[0]))):
        write_mapped(layers, keys, values, slots, plan)
        written.append([layer.kv_cache.clone() for layer in layers])
        for layer, cache in zip(layers, saved, strict=True):
            layer.kv_cache.copy_(cache)
    return all(torch.equal(a, b) for a, b in zip(*written, strict=True)) and not torch.equal(written[0][0], saved[0])


def generate(llm, prompts, params=None, n: int = 4, salt: str | None = None):
    """Greedy outputs (2 logprobs per step) of one batch; `params` the kv_transfer_params of every prompt, or a list;
    `salt` every prompt's cache_salt."""
    from vllm import SamplingParams

    batch = prompts if isinstance(prompts[0], list) else [prompts]
    given = params if isinstance(params, list) else [params] * len(batch)
    sampling = [
        SamplingParams(temperature=0.0, max_tokens=n, logprobs=2, detokenize=False,
                       extra_args=None if p is None else {"kv_transfer_params": p})
        for p in given
    ]  # fmt: skip
    from src.serving.params import prompt

    outputs = llm.generate([prompt(p, salt) for p in batch], sampling, use_tqdm=False)
    return outputs if isinstance(prompts[0], list) else outputs[0]


def tokens(output) -> list[int]:
    return list(output.outputs[0].token_ids)


def logprobs(output) -> torch.Tensor:
    """[steps, 2]: the two top log-probabilities of each step."""
    return torch.tensor([sorted(e.logprob for e in step.values())[-2:] for step in output.outputs[0].logprobs])


def record(output) -> dict:
    return (output.kv_transfer_params or {}).get("kvrelay", {})


def export(llm, prompt: list[int]) -> str:
    out = generate(llm, prompt, {"kvrelay": {"export": True}}, n=1)
    assert record(out)["export_tokens"] == len(prompt)
    return record(out)["export"]


def handoff(export_id: str, mapper: str) -> dict:
    return {"kvrelay": {"handoff": {"export": export_id, "mapper": mapper}}}


def assert_spliced(llm, pair: ServingPair, transport, export_id: str, prompt: list[int], conversation: list[int],
                   done: dict) -> None:  # fmt: skip
    """The K/V `llm` holds for `conversation` after the handoff `done` (its record) from the small model's export of
    `prompt` equal kvrelay's own DynamicCache splice of that export (src/runtime/splice.py `spliced_cache`): the
    mapped span tightly, the tokens read natively on top of it within float tolerance; and the export holds the
    small model's own prefill."""
    import pickle

    from src.apply import KVTransfer
    from src.artifact import load_mapper
    from src.maps import cache_layers
    from src.models import load_model
    from src.runtime.plan import Levers
    from src.runtime.splice import spliced_cache

    end = done["end"]
    parts = [pickle.loads(p) for p in llm.collective_rpc(paged_kv, args=(done["blocks"], len(conversation)))]
    keys, values = (torch.cat([p[i] for p in parts], 1) for i in (0, 1))  # [L_t, H_t, T, d]: the ranks' heads in order
    small, large = load_model(pair.small), load_model(pair.large)
    source_k, source_v, _ = transport.load(export_id, 0, len(prompt))  # [L_s, H_s, T, d]
    native = small(torch.tensor([prompt]), use_cache=True).past_key_values
    for layer, (k, v) in enumerate(cache_layers(native)):
        torch.testing.assert_close(source_k[layer], k[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(source_v[layer], v[0], atol=1e-4, rtol=1e-4)
    transfer = KVTransfer(load_mapper(pair.fitted), small, large, pair.tokenizer_hash)
    source = [(k[None], v[None]) for k, v in zip(source_k, source_v, strict=True)]
    levers = Levers(native_sink=done["start"], hold_back=len(conversation) - end)
    reference = cache_layers(spliced_cache(transfer, source, torch.tensor([conversation]), levers))
    want_k = torch.stack([k[0] for k, _ in reference])  # [L_t, H_t, T, d]
    want_v = torch.stack([v[0] for _, v in reference])
    scale = want_k.abs().max()
    span = slice(done["start"], end)
    torch.testing.assert_close(keys[:, :, span], want_k[:, :, span], atol=1e-5 * scale, rtol=0)  # the map
    torch.testing.assert_close(values[:, :, span], want_v[:, :, span], atol=1e-5 * scale, rtol=0)
    torch.testing.assert_close(keys[:, :, end:], want_k[:, :, end:], atol=1e-4 * scale, rtol=0)  # read on top
    torch.testing.assert_close(values[:, :, end:], want_v[:, :, end:], atol=1e-4 * scale, rtol=0)
