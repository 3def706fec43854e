"""Token lengths of a routed workload's histories (what the source reads and the target receives mapped), per task,
with the pair's tokenizer: do they fit the length guard (policy.max_length_factor × the calibration length)?
Any overrides of `+experiment=routed` apply (the budget decides which shots are calibration text, hence the pool).

    python scripts/history_tokens.py --tokenizer ~/.cache/kvrelay/models/qwen25coder_1p5b \\
        +workload=fewshot budget=paper_mix workload.limit=800 "workload.tasks=[arc_easy,arc_challenge]" \\
        workload.shots.arc_easy=200 workload.shots.arc_challenge=200 paths.data=../shared/data
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from src.routed_workloads import examples  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, help="a model folder holding the pair's tokenizer")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of +experiment=routed")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("run", overrides=["+experiment=routed", *args.overrides])
    guard = cfg.policy.max_length_factor * cfg.budget.seq_len
    chosen = examples(cfg, cfg.workload.name)
    for task in cfg.workload.tasks:
        lengths = np.array(
            [len(tokenizer.encode(ex.history, add_special_tokens=False)) for ex in chosen if ex.item.task == task]
        )
        print(
            f"{task}: {lengths.size} histories, tokens min / median / max {lengths.min()} / {int(np.median(lengths))} / "
            f"{lengths.max()}; {int((lengths > guard).sum())} beyond the length guard ({guard:g})"
        )


if __name__ == "__main__":
    main()
