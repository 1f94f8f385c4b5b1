"""The cache state and its math: storage formats (`quant`, `stores`), the per-layer caches
(`cache`), their reshaping (`layout`, `selection`), attention written in jnp (`attention`),
the statistics a model collects for policies (`stats`) and the transform protocol
(`transforms`). Imports nothing from the other subsystems."""
