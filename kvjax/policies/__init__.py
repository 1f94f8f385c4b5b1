"""What to keep and how to store it: eviction scorers and wrappers (`eviction*`), codecs
(`codecs`), low-rank projection (`low_rank`), recurrent state for evicted tokens (`recurrent`,
`feature_maps`) and the method registry that parses a spec like `snapkv:0.5+kivi:4`
(`methods`). Builds on `kvjax.core` only."""
