"""Benchmark scripts: each writes JSON/CSV (and PNG where it plots) that `docs/BENCHMARKS.md`
cites with its command. Run them with `python -m experiments.bench.NAME --help`; tests do not
import them."""
