"""`kvjax eval` / `kvjax bench`: grids of (task, length, method) cells on a real model.
`grid` (types, config, rows) <- `cells` (the kvjax engine), `kvpress_engine` <- `harness` (the
sweep) <- `report` (tables, plots, RESULTS' generated section); the tasks `passkey`, `ruler`,
`ppl`; `hf_reference` (transformers' side of the parity checks)."""
