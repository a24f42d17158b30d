"""At temperature 0 in float32 on the CPU the engine's tokens equal plain transformers greedy generation, token for
token, with several prompts of different lengths in flight at once."""
from enginecore.cpu_linear import OneDnnFloat32Linear
from tests.test_engine_support import (  # noqa: F401
    engine_block_bytes, greedy_request, make_engine, prompts, record_preemptions, reference_greedy,
)

MAX_TOKENS = 20


def _run(engine, prompts, max_tokens=MAX_TOKENS):
    return engine.generate([greedy_request(f"r{i}", p, max_tokens) for i, p in enumerate(prompts)])


def test_greedy_matches_transformers_concurrently(prompts):
    engine = make_engine(enable_prefix_caching=False)
    out = _run(engine, prompts)
    for i, prompt in enumerate(prompts):
        assert out[(f"r{i}", 0)] == reference_greedy(prompt, MAX_TOKENS), f"prompt {i} ({len(prompt)} tokens)"
    assert engine.pool.num_free == engine.pool.num_blocks


def test_greedy_matches_with_prefix_caching_and_chunked_prefill(prompts):
    # A small token budget cuts the long prompts into chunks; the second round hits the prefix cache.
    engine = make_engine(enable_prefix_caching=True, max_num_batched_tokens=64)
    first = _run(engine, prompts)
    second = _run(engine, prompts)
    for i, prompt in enumerate(prompts):
        expected = reference_greedy(prompt, MAX_TOKENS)
        assert first[(f"r{i}", 0)] == expected, f"prompt {i}, cold cache"
        assert second[(f"r{i}", 0)] == expected, f"prompt {i}, warm cache"
    assert engine.pool.num_free == engine.pool.num_blocks


def test_prefix_cache_hits_are_reported(prompts):
    engine = make_engine(enable_prefix_caching=True)
    prompt = prompts[-1]
    outputs = []
    for round_ in range(2):
        engine.add_request(greedy_request(f"x{round_}", prompt, 4))
        while engine.has_work():
            outputs += [o for _, o in engine.step() if o.request_id == f"x{round_}"]
    cached = [o.num_cached_tokens for o in outputs]
    bs = engine.block_size
    assert cached[0] == 0 and cached[-1] == (len(prompt) - 1) // bs * bs > 0


def test_greedy_matches_across_preemption(prompts):
    # 12 blocks of 16 tokens cannot hold every sequence at once: the newest are preempted and recomputed.
    engine = make_engine(kv_cache_memory=12 * engine_block_bytes(), max_num_batched_tokens=128)
    preempted = record_preemptions(engine)
    short = [p for p in prompts if len(p) < 100]
    out = _run(engine, short * 2, max_tokens=24)
    assert preempted, "the pool was meant to run out"
    for i, prompt in enumerate(short * 2):
        assert out[(f"r{i}", 0)] == reference_greedy(prompt, 24), f"prompt {i}"
    assert engine.pool.num_free == engine.pool.num_blocks


def test_cpu_engine_runs_the_lean_forward_in_the_layout_measured_faster():
    from enginecore.cpu_setup import float32_layout

    engine = make_engine()
    model = engine.loaded.model
    lean = engine.runner.lean_model
    assert lean is not None, "a Llama model on the CPU runs the lean forward"
    layout = float32_layout(model)
    assert layout["row_major_s"] > 0 and layout["column_major_s"] > 0
    qkv = lean.layers[0].qkv
    if layout["kernel"] == "onednn":
        assert isinstance(qkv, OneDnnFloat32Linear) and layout["onednn_s"] <= layout["row_major_s"]
    else:
        column_major = layout["kernel"] == "column-major"
        assert qkv.column_major == column_major
        assert qkv.weight.stride() == ((1, qkv.out_features) if column_major else (qkv.in_features, 1))
    embedding = model.get_input_embeddings().weight
    assert embedding.is_contiguous()  # lookups read whole rows; the transformers model itself is left as loaded
    assert model.model.layers[0].self_attn.q_proj.weight.is_contiguous()


def test_a_prefix_cache_hash_collision_serves_the_prompts_own_tokens(prompts, monkeypatch):
    # Every block hashes alike, as crafted prompts could under a weak hash: a second prompt must still get its own
    # KV, not the cached blocks of the first.
    import enginecore.block_pool
    import enginecore.sequence

    def collide(parent, token_ids):
        return b"collision"

    monkeypatch.setattr(enginecore.block_pool, "hash_block", collide)
    monkeypatch.setattr(enginecore.sequence, "hash_block", collide, raising=False)  # where it was looked up before
    engine = make_engine(enable_prefix_caching=True)
    first, second = prompts[3], prompts[4]  # 85 and 228 tokens: several full blocks each
    engine.generate([greedy_request("first", first, 1)])
    out = []
    engine.add_request(greedy_request("second", second, 8))
    while engine.has_work():
        out += [o for _, o in engine.step()]
    assert [t for o in out for t in o.new_token_ids] == reference_greedy(second, 8)
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)  # the chat template's head
    assert out[0].num_cached_tokens == shared // engine.block_size * engine.block_size  # only what truly matches
