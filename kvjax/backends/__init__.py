"""Where attention runs: `dispatch.attend` picks, per layer kind and `impl`, the jnp reference
(`kvjax.core.attention`), the Pallas kernels (`pallas`, over `kernels_pallas`), the per-shard
kernel on a mesh (`sharded`) or the CPU C++ kernel (`cpu_kernel`). Builds on `core` and
`memory`."""
