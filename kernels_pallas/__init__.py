"""Pallas kernels (TPU Mosaic, GPU Triton) beside plain-jnp references.

- `paged_attention`: attention of each sequence's queries over its pages of a
  key/value pool (decode and prefill chunks), pages decoded in the kernel.
- `page_formats`: how a page is stored (dense, per-token packed, KIVI
  per-channel) and decoded, shared by kernels and references.

`kvjax.attend(impl="pallas")` dispatches here on TPU/GPU; tests run the
kernels in interpret mode on CPU and lower them with `jax.export`.
"""
