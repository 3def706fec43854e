"""Choosing levers on validation items (src/choose.py): only FINISHED routed runs on validation items are read, the
pre-registered rule picks the least prefill within the loss threshold (else the least mean loss), and the CLI prints
the chosen overrides alone on stdout, under today's keys (`policy.levers.*`) for records made before they moved."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from src.choose import choose, overrides, validation_runs
from src.records import pack

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared/data"


def _record(
    root: Path, name: str, levers: dict, losses: dict, prefill: float, mean: float | None = None,
    keys: str = "policy.levers.", **tags,
):  # fmt: skip
    """A routed record; `keys="eval.levers."`: one made before 2026-12-05, when the levers lived under conf/eval."""
    tags = {"job": "routed", "split": "valid", "workload": "passage", "direction": "a_to_b"} | tags
    metrics = {f"task.{t}.loss_points": v for t, v in losses.items()}
    mean = sum(losses.values()) / len(losses) if mean is None else mean
    metrics |= {"task.mean.loss_points": mean, "prefill_fraction": prefill}
    folder = root / name
    folder.mkdir(parents=True)
    record = {
        "name": name,
        "status": tags.pop("status", "FINISHED"),
        "params": {f"{keys}{k}": str(v) for k, v in levers.items()} | {"fit.k": "24"},
        "tags": tags,
        "metrics": [{"key": k, "value": v, "step": None, "timestamp": 0} for k, v in metrics.items()],
    }
    (folder / "record.json").write_text(json.dumps(record))


@pytest.fixture
def grid(tmp_path):
    _record(tmp_path, "pure", {"recompute": 0.0}, {"boolq": 30.0, "lambada": 38.0}, 0.0)
    _record(tmp_path, "r10", {"recompute": 0.1}, {"boolq": 0.5, "lambada": 1.5}, 0.15)  # one task over 1 pt
    _record(tmp_path, "r25", {"recompute": 0.25}, {"boolq": 0.8, "lambada": 0.2}, 0.33, keys="eval.levers.")  # old
    _record(tmp_path, "r40", {"recompute": 0.4}, {"boolq": 0.0, "lambada": -1.0}, 0.48)
    _record(tmp_path, "on_test", {"recompute": 0.05}, {"boolq": 0.0, "lambada": 0.0}, 0.1, split="test")
    _record(tmp_path, "no_split", {"recompute": 0.05}, {"boolq": 0.0, "lambada": 0.0}, 0.1, split=None)
    _record(tmp_path, "failed", {"recompute": 0.05}, {"boolq": 0.0, "lambada": 0.0}, 0.1, status="FAILED")
    _record(tmp_path, "other", {"recompute": 0.05}, {"boolq": 0.0, "lambada": 0.0}, 0.1, workload="fewshot")
    return tmp_path


def test_the_least_prefill_within_the_threshold_on_validation_runs_only(grid):
    runs = validation_runs(grid, workload="passage")
    assert sorted(r["name"] for r in runs) == ["pure", "r10", "r25", "r40"]  # never test items, never failed runs
    assert choose(runs)["name"] == "r25"  # r10 is cheaper but one task loses 1.5 points
    assert choose(runs, max_loss=2.0)["name"] == "r10"
    assert choose([r for r in runs if r["name"] in ("pure", "r10")])["name"] == "r10"  # none within: least mean loss
    assert overrides(choose(runs)) == ["policy.levers.recompute=0.25"]  # an old record's levers under today's keys
    vattn = choose(runs) | {"params": choose(runs)["params"] | {"fit.v_space": "attention"}}
    assert overrides(vattn) == ["fit.v_space=attention", "policy.levers.recompute=0.25"]  # the mapper's lever travels
    with pytest.raises(ValueError, match="no finished routed runs on validation items"):
        choose(validation_runs(grid, workload="switches"))


def test_cli_prints_only_the_overrides_on_stdout(grid):
    done = subprocess.run(
        [sys.executable, "-m", "src.choose", str(grid), "--workload", "passage"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert done.stdout == "policy.levers.recompute=0.25\n"  # what `python -m src.run` takes today
    assert "→ policy.levers.recompute=0.25" in done.stderr and done.stderr.count("\n") == 5
    assert "no run kept its items: compared by their logged metrics, pairing unverified" in done.stderr


def test_a_partial_grid_is_refused(grid):
    """--expect: a grid with a setting lost (a cut step, a share out of memory) chooses nothing."""
    command = [sys.executable, "-m", "src.choose", str(grid), "--workload", "passage", "--expect"]
    whole = subprocess.run([*command, "4"], cwd=REPO, capture_output=True, text=True)
    assert whole.returncode == 0 and whole.stdout == "policy.levers.recompute=0.25\n"
    partial = subprocess.run([*command, "5"], cwd=REPO, capture_output=True, text=True)
    assert partial.returncode == 1 and partial.stdout == ""
    assert "4 of the grid's 5 lever settings have a finished validation run" in partial.stderr
    record = grid / "pure" / "record.json"  # a run of another stage (signal) in the same folder: not the grid's
    record.write_text(json.dumps(json.loads(record.read_text()) | {"experiment": "error_signal"}))
    for path in grid.glob("r*/record.json"):
        path.write_text(json.dumps(json.loads(path.read_text()) | {"experiment": "routed_frontier3"}))
    own = subprocess.run([*command, "4", "--experiment", "routed_frontier3"], cwd=REPO, capture_output=True, text=True)
    assert own.returncode == 1 and "3 of the grid's 4 lever settings" in own.stderr


def test_cli_without_validation_runs_says_so(tmp_path):
    done = subprocess.run([sys.executable, "-m", "src.choose", str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 1 and done.stdout == ""
    assert (
        done.stderr.startswith("choose: no finished routed runs on validation items") and "Traceback" not in done.stderr
    )


def _item(index: int, routed_right: bool) -> dict:
    """A boolq item whose native sessions answer right and the routed one as told (label 0, two choices)."""
    right, wrong = [[-0.1, 1.0], [-2.0, 0.0]], [[-2.0, 0.0], [-0.1, 1.0]]
    scores = {"native_target": right, "native_source": right, "routed": right if routed_right else wrong}
    handoff = {"prefill_fraction": 0.5}
    nll = {"native_target": 0.1, "native_source": 0.1, "routed": 0.1 if routed_right else 2.0}
    return {"task": "boolq", "index": index, "label": 0, "lengths": [2, 3], "history_tokens": 80, "turn_tokens": 10} | {
        "scores": scores,
        "nll": nll,
        "handoff": handoff,
    }


def test_data_rescoring_drops_the_items_a_reported_test_run_scores(tmp_path):
    """Item 32 of boolq is a test item at limit 100 (stride 32): with --data the run is re-scored without it."""
    _record(tmp_path, "leaky", {"recompute": 0.1}, {"boolq": 50.0}, 0.2)
    (tmp_path / "leaky/record.json").write_text(
        (tmp_path / "leaky/record.json")
        .read_text()
        .replace('"fit.k": "24"', '"fit.k": "24", "workload.limit": "50", "eval.tasks.n_boot": "200", "seed": "0"')
    )
    (tmp_path / "leaky/artifacts/routed").mkdir(parents=True)
    items = [_item(32, routed_right=False), _item(33, routed_right=True), _item(97, routed_right=True)]
    (tmp_path / "leaky/artifacts/routed/items.json").write_text(json.dumps({"items": items}))
    (logged,) = validation_runs(tmp_path)
    (rescored,) = validation_runs(tmp_path, data=DATA)
    assert logged["metrics"]["task.boolq.loss_points"] == 50.0
    assert rescored["metrics"]["task.boolq.loss_points"] == 0.0 and rescored["metrics"]["prefill_fraction"] == 0.2


def test_a_run_whose_losses_are_nan_is_never_chosen(tmp_path):
    """NaN compares false both ways, so `min` would keep a NaN run met first: it is left out instead; a NaN prefill
    fraction counts as spending everything."""
    nan = float("nan")
    _record(tmp_path, "a_nan_task", {"recompute": 0.05}, {"boolq": nan, "lambada": 0.0}, 0.0)  # first in path order
    _record(tmp_path, "b_nan_mean", {"recompute": 0.06}, {"boolq": 0.0, "lambada": 0.0}, 0.0, mean=nan)
    _record(tmp_path, "pure", {"recompute": 0.0}, {"boolq": 30.0, "lambada": 38.0}, 0.0)
    runs = validation_runs(tmp_path)
    assert [r["name"] for r in runs] == ["a_nan_task", "b_nan_mean", "pure"]
    assert choose(runs)["name"] == "pure"  # none within the margin: the least mean loss among finite ones
    _record(tmp_path, "c_nan_prefill", {"recompute": 0.1}, {"boolq": 0.5, "lambada": 0.5}, nan)
    _record(tmp_path, "r25", {"recompute": 0.25}, {"boolq": 0.8, "lambada": 0.2}, 0.33)
    assert choose(validation_runs(tmp_path))["name"] == "r25"  # 0.33 spent beats an unknown (NaN) spend
    with pytest.raises(ValueError, match="no validation run has finite losses on every task and the mean"):
        choose(runs[:2])


def _with_items(root: Path, name: str, recompute: float, prefill: float, right: dict[int, bool]) -> None:
    """A validation run that kept its items: boolq items `right` (index → routed right), its logged loss from them."""
    loss = 100.0 * sum(not r for r in right.values()) / len(right)
    _record(root, name, {"recompute": recompute}, {"boolq": loss}, prefill)
    record = root / name / "record.json"
    record.write_text(
        record.read_text().replace('"fit.k": "24"', '"fit.k": "24", "eval.tasks.n_boot": "200", "seed": "0"')
    )
    (root / name / "artifacts/routed").mkdir(parents=True)
    items = [_item(index, routed_right=r) for index, r in right.items()]
    (root / name / "artifacts/routed/items.json").write_text(json.dumps({"items": items}))


def test_runs_that_scored_different_items_are_compared_on_the_items_they_share(tmp_path, capsys):
    """`cheap` lost 2 of its 200 items (logged: 1.0 point, within the 1-point bar, and the least prefill); `dear`
    scored 100 of them and lost none. Paired on those 100, cheap loses 2.0 points: `dear` is chosen."""
    shared = {i: True for i in range(100)}
    _with_items(tmp_path, "cheap", 0.1, 0.1, shared | {0: False, 1: False} | {i: True for i in range(100, 200)})
    _with_items(tmp_path, "dear", 0.4, 0.4, shared)
    runs = validation_runs(tmp_path)
    losses = {r["name"]: r["metrics"]["task.boolq.loss_points"] for r in runs}
    assert losses == {"cheap": pytest.approx(2.0), "dear": 0.0}
    assert choose(runs)["name"] == "dear"
    assert "cheap: compared on the 100 items every run scored (of its 200)" in capsys.readouterr().err
    assert len(pack([tmp_path])) == 2  # items packed, as committed records keep them: read alike (NaN included)
    assert json.dumps(validation_runs(tmp_path)) == json.dumps(runs)


def test_runs_that_cannot_be_paired_are_refused(tmp_path):
    _with_items(tmp_path, "a", 0.1, 0.1, {0: True, 1: True})
    _record(tmp_path, "b_no_items", {"recompute": 0.2}, {"boolq": 0.0}, 0.2)
    with pytest.raises(ValueError, match=r"runs \['b_no_items'\] kept no items"):
        validation_runs(tmp_path)
    (tmp_path / "b_no_items/record.json").unlink()
    _with_items(tmp_path, "c", 0.2, 0.2, {5: True, 6: True})
    with pytest.raises(ValueError, match="share no item"):
        validation_runs(tmp_path)


def test_runs_that_share_a_name_are_paired_each_on_its_own_items(tmp_path):
    """Two records named alike (a rerun on other items): each is re-scored on the items both scored. Keyed by name,
    the second's items stood for both, and it kept the item the first never scored (its loss stayed 25 points)."""
    _with_items(tmp_path, "first", 0.1, 0.1, {i: True for i in range(4)})
    _with_items(tmp_path, "rerun", 0.1, 0.1, {2: True, 3: True, 4: False, 5: True})
    for folder in ("first", "rerun"):
        record = tmp_path / folder / "record.json"
        record.write_text(record.read_text().replace(f'"name": "{folder}"', '"name": "same"'))
    runs = validation_runs(tmp_path)
    assert [r["metrics"]["task.boolq.loss_points"] for r in runs] == [0.0, 0.0]  # both on items 2 and 3
