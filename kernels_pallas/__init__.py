"""Pallas kernels (TPU Mosaic, GPU Triton) beside plain-jnp references.

- `paged_attention`: attention of each sequence's queries over its pages of a
  key/value pool (decode and prefill chunks), pages decoded in the kernel.
- `page_formats`: how a page is stored (dense, per-token packed, KIVI
  per-channel) and decoded, shared by kernels and references.
- `paged_attention_mgpu`: the same contract as a Mosaic GPU (Hopper) kernel:
  TMA pipeline, wgmma, per-token packed pages dequantized in registers.
  Called explicitly (`attend(impl="pallas")` on GPU stays on Triton until a
  GPU has run it); proven in GPU interpret mode (`tests/test_mgpu_kernel.py`).

- `tpu_compile`: compile for a TPU without one (deviceless libtpu).
- `gpu_lowering`: the Triton IR a function lowers to for CUDA, and (with the
  `triton` package) its sm_90a compile: registers, shared memory, loop SASS.

`kvjax.attend(impl="pallas")` dispatches here on TPU/GPU; tests run the
kernels in interpret mode on CPU, lower them with `jax.export`, and compile
them with the real Mosaic compiler for v5e/v6e (`tests/test_tpu_compile.py`).
"""
