"""Paged memory: a shared page pool and its page tables (`paging`), the host tier and its
prefetch (`tiers`), and KIVI-quantized pages (`paged_kivi`). Builds on `kvjax.core`."""
