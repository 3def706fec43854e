"""The cache directory of the mapper a fit job just used: its record (tracking.backend=json) logs the mapper's
manifest (artifacts/mapper/manifest.json); the cached artifact under `paths.home`/mappers whose manifest holds the
same coefficients (tensor_sha256) is the one. Prints its path; exits 1 naming what it did not find.

    python scripts/find_mapper.py $OUT/trk-fit-qwen25coder_0p5b_to_1p5b /tmp/kvh/mappers
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def find(records: Path, mappers: Path) -> Path:
    """The mapper directory under `mappers` of the newest run under `records` (module docstring); ValueError if none."""
    logged = sorted(records.glob("*/artifacts/mapper/manifest.json"), key=lambda p: p.stat().st_mtime)
    if not logged:
        raise ValueError(f"no run under {records} logged a mapper manifest")
    sha = json.loads(logged[-1].read_text())["tensor_sha256"]
    for manifest in sorted(mappers.glob("*/manifest.json")):
        if json.loads(manifest.read_text()).get("tensor_sha256") == sha:
            return manifest.parent
    raise ValueError(f"no mapper under {mappers} holds the coefficients {sha[:12]} that {logged[-1]} names")


if __name__ == "__main__":
    try:
        print(find(Path(sys.argv[1]), Path(sys.argv[2])))
    except ValueError as error:
        sys.exit(f"find_mapper: {error}")
