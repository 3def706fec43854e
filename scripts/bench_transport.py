"""The export transport's host cost, alone: `Transport.put` and `Transport.header` of one rank's host export of T
tokens (tiny K/V: the ids and the file's handling dominate), p50 over repeats, into a directory on tmpfs.

    python scripts/bench_transport.py --tokens 8192 --out /tmp/transport.json
    git show REV:src/serving/transport.py > /tmp/transport_rev.py
    python scripts/bench_transport.py --module /tmp/transport_rev.py --out /tmp/transport_rev.json   # another version
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--module", type=Path, default=ROOT / "src/serving/transport.py", help="a transport.py to time")
    parser.add_argument("--directory", default="/dev/shm")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    spec = importlib.util.spec_from_file_location("transport_under_test", args.module)
    transport_module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = transport_module  # its dataclasses look their module up
    spec.loader.exec_module(transport_module)
    transport = transport_module.Transport(tempfile.mkdtemp(prefix="kvrelay-bench-", dir=args.directory))
    ids = list(range(100, 100 + args.tokens))
    keys, values = torch.zeros(2, 2, args.tokens, 4), torch.ones(2, 2, args.tokens, 4)  # [L, H, T, d]
    put_ms, header_ms = [], []
    for repeat in range(args.repeats):
        began = time.perf_counter()
        transport.put(f"e{repeat}", keys, values, ids, "fp", "tok", (0, 2, 2), fingerprint_dtype="float32")
        put_ms.append((time.perf_counter() - began) * 1e3)
        began = time.perf_counter()
        transport.header(f"e{repeat}")
        header_ms.append((time.perf_counter() - began) * 1e3)
    result = {"bench": "transport", "module": str(args.module), "tokens": args.tokens, "repeats": args.repeats,
              "directory": args.directory, "put_ms_p50": statistics.median(put_ms),
              "header_ms_p50": statistics.median(header_ms), "machine": platform.processor() or platform.machine(),
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    args.out.write_text(json.dumps(result, indent=2))
    print(f"put p50 {result['put_ms_p50']:.2f} ms, header p50 {result['header_ms_p50']:.2f} ms ({args.tokens} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
