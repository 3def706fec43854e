"""BENCHMARKS.md's and README.md's tables rebuilt from tracking records (results/, or an MLflow store): rows
(`rows`), the quality, routed, engine and front-door (`headline`) tables that render them, and the marked-table rebuild
and check per page (`benchmarks`). Command line: scripts/tables.py."""
