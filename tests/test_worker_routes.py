"""The vLLM worker's routes (src/serving/routes.py `bound_routes`) are verified without loading the models: the
identities are streamed from the files and the KV interfaces and rotary modules come from the configs, and what is
bound is what loading the models binds. Files that cannot be matched fall back to the load, saying why; a refusal
still stops the start. The tiny serving pair of tests/vllm_pair.py (random weights: correctness only)."""

import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from vllm_pair import serving_pair

import src.serving.routes as routes
from src.model_identity import SINGLE, NotStreamable
from src.rope import rope_cos_sin
from src.serving.config import RouteSpec


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return serving_pair(tmp_path_factory.mktemp("pair"))


def _specs(pair) -> tuple[RouteSpec, ...]:
    return RouteSpec(mapper=pair.fitted, source=pair.small), RouteSpec(mapper=pair.identity, source=pair.large)


def _bind(pair, target=None):
    return routes.bound_routes(_specs(pair), target or pair.large, torch.float32, torch.float32, "torch", "cpu")


def _no_load(*args, **kwargs):
    raise AssertionError("a model was loaded on the host")


def _not_streamable(path, dtype, model=None):
    raise NotStreamable("planted")


def _assert_same(bound, loaded):
    assert bound.keys() == loaded.keys()
    positions = torch.arange(300)
    for key in bound:
        a, b = bound[key], loaded[key]
        assert (a.source_kv, a.target_kv, a.backend) == (b.source_kv, b.target_kv, b.backend)
        for name, t in a.mapper.tensors().items():
            assert torch.equal(t, getattr(b.mapper, name)), name
        for mine, theirs in ((a.source_rope, b.source_rope), (a.target_rope, b.target_rope)):
            for x, y in zip(rope_cos_sin(mine.rotary, positions), rope_cos_sin(theirs.rotary, positions), strict=True):
                assert torch.equal(x, y)


def test_routes_bind_without_loading_a_model_and_bind_what_loading_binds(pair, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(routes, "load_model", _no_load)
        identity, bound = _bind(pair)
    with monkeypatch.context() as patch:
        patch.setattr(routes, "streamed_identity", _not_streamable)  # today's path: both models loaded
        loaded_identity, loaded = _bind(pair)
    assert identity == loaded_identity and identity.tokenizer_hash == pair.tokenizer_hash
    assert len(bound) == 2
    _assert_same(bound, loaded)


def test_files_that_cannot_be_streamed_fall_back_to_the_load_and_say_why(pair, tmp_path, caplog):
    large = tmp_path / "large"
    shutil.copytree(pair.large, large)
    tensors = load_file(large / SINGLE) | {"model.extra.weight": torch.zeros(3)}  # dropped by the loader
    save_file(tensors, large / SINGLE, metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger=routes.__name__):
        identity, bound = routes.bound_routes(
            (RouteSpec(mapper=pair.fitted, source=pair.small),), large, torch.float32, torch.float32, "torch", "cpu"
        )
    reason = f"{SINGLE}: model.extra.weight is not a tensor of the model"
    assert [r.getMessage() for r in caplog.records if "not streamed" in r.getMessage()] == [
        f"kvrelay: {large}: identity not streamed ({reason}): loading the model on the host"
    ]
    assert identity == _bind(pair)[0] and len(bound) == 1


@pytest.mark.parametrize("wrong", ["source", "dtype"])
def test_a_route_of_another_pair_is_refused_naming_the_fingerprint(pair, monkeypatch, wrong):
    """The fitted mapper is the small model's: from the large one, or fingerprinted in another dtype, it is refused."""
    monkeypatch.setattr(routes, "load_model", _no_load)
    source, dtype = (pair.large, torch.float32) if wrong == "source" else (pair.small, torch.bfloat16)
    with pytest.raises(ValueError, match="cannot serve: mapper refused: .* source fingerprint"):
        routes.bound_routes((RouteSpec(pair.fitted, source),), pair.large, dtype, torch.float32, "torch", "cpu")


def test_a_routes_coefficients_default_to_the_dtype_its_mapper_was_fitted_in(pair, monkeypatch):
    """compute_dtype None ("fitted", the connector's default): each mapper's own fit's pair.compute_dtype — float32
    coefficients run at full precision inside vLLM's workers, so a bf16 fit served in float32 was a silent slowdown;
    a dtype given is used as given."""
    spec = (RouteSpec(mapper=pair.fitted, source=pair.small),)
    monkeypatch.setattr(routes, "fitted_dtypes", lambda manifest: {"fingerprint_dtype": "float32",
                                                                   "compute_dtype": "bfloat16"})  # fmt: skip
    _, fitted = routes.bound_routes(spec, pair.large, torch.float32, None, "torch", "cpu")
    _, given = routes.bound_routes(spec, pair.large, torch.float32, torch.float32, "torch", "cpu")
    assert {b.mapper.weight_k.dtype for b in fitted.values()} == {torch.bfloat16}
    assert {b.mapper.weight_k.dtype for b in given.values()} == {torch.float32}


def test_a_gemm_route_for_a_mapper_reading_few_source_layers_says_what_it_costs(pair, caplog):
    """apply_backend "gemm" packs every source layer: for a mapper reading few of them (k < 0.75 L_s) the worker says
    at start how many times the gathered map's work it multiplies (the vLLM bench's k = 2 mapper: 12×, 2026-12-07);
    a mapper reading them all (the fitted one: k = 2 of the small model's 2) starts silently."""
    fitted, identity = (
        (RouteSpec(pair.fitted, pair.small),),
        (RouteSpec(pair.identity, pair.large),),
    )  # k 2 of 2, 1 of 3
    with caplog.at_level(logging.WARNING, logger=routes.__name__):
        routes.bound_routes(fitted, pair.large, torch.float32, None, "gemm", "cpu")
        assert not [r for r in caplog.records if "apply_backend" in r.getMessage()]
        routes.bound_routes(identity, pair.large, torch.float32, None, "gemm", "cpu")
    (line,) = [r.getMessage() for r in caplog.records if "apply_backend" in r.getMessage()]
    assert "multiplies all 3 source layers for a mapper reading 1 per target layer — 3.0× the gathered map's" in line
