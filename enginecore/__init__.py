"""The engine core: model, KV cache, scheduler and sampler in one process per data-parallel rank."""
