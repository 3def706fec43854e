"""lm-eval's own command line runs a local multiple-choice task through `kvrelay` (`python -m src.eval.harness`:
lm-eval's CLI with the model registered), built from model_args alone — source and target saved with
`save_pretrained` beside a shared word-level tokenizer, and a saved mapper artifact.

The pair is `tests.exact_pair` (the target's cache is an exact map of the source's, its logits differ). The CLI
run — the exact mapper in `transfer` mode with a native sink and a hold-back — and `native_target` (from a
model_args string in Python) score every choice as lm-eval's own `hf` model on the target does (1e-4); the
perturbed mapper does not, and its levers change its scores (a transfer that ignored its mapper or levers, or
read the target's own prefill, fails here).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from src.artifact import ArtifactError, Mapper, save_mapper
from src.models import tokenizer_hash
from tests.conftest import TINY
from tests.exact_pair import exact_pair

pytest.importorskip("lm_eval")

ROOT = Path(__file__).parents[1]
WORDS = [f"w{index}" for index in range(2, TINY["vocab_size"])]
DOCS = [  # contexts of 3–9 words: the sink (1) and hold-back (1) leave tokens to map
    {"query": "w5 w17 w3", "choices": ["w8", "w9 w10", "w11 w12 w13"], "gold": 0},
    {"query": "w20 w21 w22 w23 w24", "choices": ["w30", "w31"], "gold": 1},
    {"query": "w40 w41 w42 w43 w44 w45 w46 w47 w48", "choices": ["w50 w51", "w52", "w53", "w54"], "gold": 2},
    {"query": "w60 w7 w60 w7", "choices": ["w60", "w7"], "gold": 0},
    {"query": "w90 w91 w92 w93", "choices": ["w94", "w95"], "gold": 1},
]
TASK = """task: kvrelay_tiny
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{query}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
metric_list:
  - metric: acc
"""


def _tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer over the tiny models' vocabulary: [UNK]=0, </s>=1, w2..w95."""
    vocab = {"[UNK]": 0, "</s>": 1, **{word: index for index, word in enumerate(WORDS, start=2)}}
    backend = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="</s>")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """Model directories, exact / wrong mapper artifacts and the folder of the tiny local task."""
    root = tmp_path_factory.mktemp("lm_eval_cli")
    tokenizer = _tokenizer()
    pair = exact_pair("llama", seed=3)
    paths = {name: root / name for name in ("source", "target", "exact", "wrong", "tasks")}
    for name, model in (("source", pair.source), ("target", pair.target)):
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    for name, mapper in (("exact", pair.exact), ("wrong", pair.wrong)):  # stamped with the real tokenizer's hash
        manifest = dict(mapper.manifest, tokenizer_hash=tokenizer_hash(tokenizer))
        save_mapper(Mapper(**mapper.tensors(), manifest=manifest), paths[name])
    paths["tasks"].mkdir()
    data = paths["tasks"] / "tiny.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (paths["tasks"] / "tiny.yaml").write_text(TASK.format(data=data, cache=root / "datasets"))
    return paths


def _cli(saved: dict[str, Path], out: Path, model_args: str) -> subprocess.Popen:
    """`python -m src.eval.harness --model kvrelay …` on the tiny task (lm-eval's CLI), started, not awaited."""
    command = [sys.executable, "-m", "src.eval.harness", "--model", "kvrelay", "--model_args", model_args]
    command += ["--tasks", "kvrelay_tiny", "--include_path", str(saved["tasks"]), "--limit", "4"]
    command += ["--output_path", str(out), "--log_samples"]  # no --device: lm-eval's cuda:0 default → the CPU here
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _cli_results(run: subprocess.Popen, out: Path) -> tuple[dict, list[list[tuple[float, bool]]]]:
    """The task's results (acc, …) and every doc's (log-likelihood, is greedy) per choice from --output_path."""
    log = run.communicate(timeout=600)[0]
    assert run.returncode == 0, log[-4000:]
    (results,) = out.rglob("results_*.json")
    (samples,) = out.rglob("samples_kvrelay_tiny_*.jsonl")
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    return json.loads(results.read_text())["results"]["kvrelay_tiny"], _scores(rows)


def _scores(rows: list[dict]) -> list[list[tuple[float, bool]]]:
    """(log-likelihood, is greedy) of every choice, docs in order (logged samples hold them as strings)."""
    rows = sorted(rows, key=lambda row: row["doc_id"])
    return [[(float(value), str(greedy) == "True") for value, greedy in row["filtered_resps"]] for row in rows]


def _evaluate(saved: dict[str, Path], model, model_args: dict | str | None = None) -> tuple[dict, list]:
    """lm_eval.simple_evaluate in this process: the task's results and per-choice scores."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    run = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["kvrelay_tiny"],
        limit=4,
        device="cpu",
        log_samples=True,
        task_manager=TaskManager(include_path=str(saved["tasks"]), include_defaults=False),  # no index of lm-eval tasks
    )
    return run["results"]["kvrelay_tiny"], _scores(run["samples"]["kvrelay_tiny"])


def _assert_same(scores: list, expected: list) -> None:
    for row, expected_row in zip(scores, expected, strict=True):
        assert [value for value, _ in row] == pytest.approx([value for value, _ in expected_row], abs=1e-4)
        assert [greedy for _, greedy in row] == [greedy for _, greedy in expected_row]


def _largest_difference(scores: list, expected: list) -> float:
    pairs = [
        (a, b) for row, other in zip(scores, expected, strict=True) for (a, _), (b, _) in zip(row, other, strict=True)
    ]
    return max(abs(a - b) for a, b in pairs)


def test_lm_eval_cli_runs_kvrelay_and_scores_as_hf(saved, tmp_path):
    import src.eval.harness  # noqa: F401  registers kvrelay in this process

    pair = f"source={saved['source']},target={saved['target']}"
    cli = _cli(saved, tmp_path / "cli", f"{pair},mapper={saved['exact']},mode=transfer,native_sink=1,hold_back=1")
    reference, expected = _evaluate(saved, "hf", {"pretrained": str(saved["target"]), "dtype": "float32"})
    assert sorted(len(row) for row in expected) == [2, 2, 3, 4] and 0.0 <= reference["acc,none"] <= 1.0

    native, native_scores = _evaluate(saved, "kvrelay", f"{pair},mode=native_target")
    assert native["acc,none"] == reference["acc,none"]
    _assert_same(native_scores, expected)

    wrong_args = f"{pair},mapper={saved['wrong']}"
    _, wrong = _evaluate(saved, "kvrelay", wrong_args)
    _, wrong_levers = _evaluate(saved, "kvrelay", f"{wrong_args},native_sink=2,hold_back=1")
    # float noise of the equal paths ≤ 1e-6; the perturbed map moves some choice by ≈ 0.05, its levers by ≈ 0.05
    assert _largest_difference(wrong, expected) > 1e-3  # the mapper is read …
    assert _largest_difference(wrong_levers, wrong) > 1e-3  # … and the levers are applied

    results, scores = _cli_results(cli, tmp_path / "cli")
    assert results["acc,none"] == reference["acc,none"] and "acc_stderr,none" in results
    _assert_same(scores, expected)


def test_model_args_are_checked_before_anything_is_served(saved):
    from src.eval.harness import KVRelayLM
    from src.runtime.plan import Levers

    pair = f"source={saved['source']},target={saved['target']}"
    lm = KVRelayLM.create_from_arg_obj(
        {"source": saved["source"], "target": saved["target"], "mapper": saved["wrong"], "native_layers": 1},
        {"batch_size": 8, "max_batch_size": None, "device": "cuda:0"},  # lm-eval's own settings, CUDA-less here
    )
    assert (lm.mode, lm.levers, lm.device.type) == ("transfer", Levers(native_layers=1), "cpu")
    assert lm.transfer.mapper.manifest["method"] == "exact+noise"
    for args, error, match in (
        (pair, ValueError, "mode=transfer needs mapper"),
        (f"{pair},mode=native,mapper={saved['exact']}", ValueError, "mode must be one of"),
        (f"{pair},pretrained=x", ValueError, r"unknown kvrelay model_args \['pretrained'\]"),
        (f"target={saved['target']}", ValueError, "need source=PATH"),
        (f"{pair},mapper={saved['exact']},native_sink=two", ValueError, "native_sink='two': expected int"),
        (f"{pair},mapper={saved['exact']},dtype=float33", ValueError, "not a torch dtype"),
        (f"{pair},mode=native_target,hold_back=2", ValueError, "mode 'native_target' maps none"),
        (f"{pair},mapper={saved['tasks']}", ArtifactError, "incomplete"),
        (f"source={saved['target']},target={saved['source']},mapper={saved['exact']}", ArtifactError, "another"),
    ):
        with pytest.raises(error, match=match):
            KVRelayLM.create_from_arg_string(args)
