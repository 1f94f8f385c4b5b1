"""The `kvjax` command line: `main.py` parses every subcommand; the `*_cmd.py` modules hold the
larger ones (`compile`, `export`/`run-exported`, `inspect`, `methods`, `train-state`) and
`launch.py` runs one JAX program as several local processes."""
