"""Around a running model: the cache monitor (`monitor`), orbax checkpoints of caches and
transform states (`checkpoint`), exported compiled decoders (`exported`) and chat templating
with special-token safety (`chat`)."""
