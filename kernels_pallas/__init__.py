"""Pallas kernels (TPU Mosaic, GPU Mosaic) beside plain-jnp references.

Empty until the kernels issue lands; `kvjax.attend(impl="xla")` is the
reference path meanwhile.
"""
