"""BENCHMARKS.md and README.md tables rebuilt from the committed tracking records in results/ (see results/README.md).

    python scripts/tables.py                        # rewrite every marked table in BENCHMARKS.md and README.md
    python scripts/tables.py --mlflow EXP … --correlate attention_output_cosine task.mean.retention   # Spearman ρ
    python scripts/tables.py --check                # exit 1 naming each page's marked tables that differ (tests too)
    python scripts/tables.py quickstart             # print registered tables
    python scripts/tables.py --records DIR          # quality tables of any record folder (e.g. a device run's)
    python scripts/tables.py --mlflow EXPERIMENT... [--uri sqlite:///mlruns/mlflow.db]   # ... of an MLflow store

The tables, their record sets, their pages and the rebuild live in src/report/ (`benchmarks.TABLES`, `PAGES`); this
is the command line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's src/, from anywhere
from src.records import RecordError  # noqa: E402
from src.report.benchmarks import PAGES, build, marked, rebuild, stale  # noqa: E402
from src.report.quality_tables import correlation, quality  # noqa: E402
from src.report.rows import mlflow_rows, record_rows  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="tables to print (TABLES keys), or experiments with --mlflow")
    parser.add_argument("--check", action="store_true", help="exit 1 when a marked table differs from its rebuild")
    parser.add_argument("--records", type=Path, help="print the quality tables of the records under this folder")
    parser.add_argument("--mlflow", action="store_true", help="print the quality tables of these MLflow experiments")
    parser.add_argument("--uri", default="sqlite:///mlruns/mlflow.db")
    parser.add_argument("--correlate", nargs=2, metavar=("METRIC", "METRIC"), help="rank correlation over the runs")
    args = parser.parse_args()
    try:
        if args.correlate:
            rows = record_rows(args.records) if args.records else mlflow_rows(args.uri, args.names)
            print(correlation(rows, *args.correlate))
        elif args.records:
            print(quality(record_rows(args.records)))
        elif args.mlflow:
            print(quality(mlflow_rows(args.uri, args.names)))
        elif args.names:
            print("\n\n".join(build(name) for name in args.names))
        elif args.check:
            differ = {page.name: found for page in PAGES if (found := stale(page.read_text(), page=page))}
            if differ:
                sys.exit(
                    f"marked tables differ from their rebuild from results/: {differ} "
                    "(run `python scripts/tables.py` and review the diff)"
                )
            counts = {page.name: len(marked(page.read_text())) for page in PAGES}
            print(
                ", ".join(f"{n} in {name}" for name, n in counts.items())
                + f": {sum(counts.values())} marked table(s) equal their rebuild from results/"
            )
        else:
            texts = {page: page.read_text() for page in PAGES}
            fresh = {page: rebuild(text, page=page) for page, text in texts.items()}  # every page, before any write
            for page, text in fresh.items():
                page.write_text(text)
                print(f"rebuilt {len(marked(text))} table(s) in {page.name}: {sorted(marked(text))}")
    except RecordError as error:
        sys.exit(f"tables: {error}")


if __name__ == "__main__":
    main()
