"""BENCHMARKS.md's tables rebuilt from tracking records (results/, or an MLflow store): rows (`rows`), the quality,
routed and engine tables that render them, and the marked-table rebuild and check (`benchmarks`). Command line:
scripts/tables.py."""
