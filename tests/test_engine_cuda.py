"""The CUDA path (skipped without a GPU): greedy tokens equal transformers' on the same GPU in float32, with CUDA
graphs and without, with asynchronous scheduling and without; in bfloat16, with either attention kernel. Uses random weights shaped like SmolLM2-135M, so it needs no model files."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MAX_TOKENS = 24
LENGTHS = (3, 17, 64, 200, 700)


# SmolLM2-135M-Instruct's architecture.
SMOLLM2_135M = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576, intermediate_size=1536,
    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
    bos_token_id=1, eos_token_id=2, pad_token_id=2, hidden_act="silu",
)


def random_model_dir(target: str) -> str:
    """A SmolLM2-135M-shaped model with random weights saved under `target`. Untied, with weights 2.5 times the
    usual init scale, so that every token of the context sways the next one and greedy choices have clear margins
    (about 1 logit): a wrong attention shows as different tokens, as with a trained model."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(**{**SMOLLM2_135M, "tie_word_embeddings": False, "initializer_range": 0.05})
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(target)
    return target


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from enginecore.loader import load_model

    return load_model(random_model_dir(str(tmp_path_factory.mktemp("model"))), "cuda", "float32")


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def references(loaded, prompts):
    model = loaded.model
    refs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
            refs.append(out[0, len(p):].tolist())
    return refs


@pytest.mark.parametrize("enforce_eager,async_scheduling", [(True, False), (False, False), (True, True), (False, True)])
def test_cuda_greedy_matches_transformers(loaded, prompts, references, enforce_eager, async_scheduling):
    from enginecore.engine import EngineCore
    from ipc.config import ServeConfig
    from ipc.messages import EngineRequest
    from ipc.sampling import SamplingParams

    config = ServeConfig(device="cuda", dtype="float32", gpu_memory_utilization=0.3, max_model_len=1024,
                         max_num_batched_tokens=512, enforce_eager=enforce_eager, async_scheduling=async_scheduling)
    engine = EngineCore(config, loaded=loaded)
    assert engine.async_scheduling == async_scheduling
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    out = engine.generate([EngineRequest(f"r{i}", p, sp) for i, p in enumerate(prompts)])
    matches = [out[(f"r{i}", 0)] == ref for i, ref in enumerate(references)]
    agreement = sum(a == b for i, ref in enumerate(references) for a, b in zip(out[(f"r{i}", 0)], ref))
    print(f"enforce_eager={enforce_eager} async_scheduling={async_scheduling}: {sum(matches)}/{len(matches)} sequences equal, "
          f"{agreement}/{MAX_TOKENS * len(references)} tokens")
    assert all(matches)
    assert engine.pool.num_free == engine.pool.num_blocks
    # Sampling runs on the GPU too.
    seeded = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, top_k=40, seed=7, logprobs=3)
    a = engine.generate([EngineRequest("s", prompts[1], seeded)])
    b = engine.generate([EngineRequest("s", prompts[1], seeded), EngineRequest("t", prompts[2], sp)])
    assert a[("s", 0)] == b[("s", 0)]


@pytest.mark.parametrize("attention_backend", ["flash", "triton"])
def test_cuda_bfloat16_tokens_are_transformers_argmax(loaded, prompts, attention_backend):
    """bfloat16 rounds differently in every kernel, so a near-tie may go either way and the texts then part. So
    each engine token (varlen attention by either kernel, graph decodes) is checked against transformers' logits for
    the engine's own text: it must be the argmax or within bfloat16 noise of it; a wrong attention is logits off."""
    from enginecore.engine import EngineCore
    from enginecore.loader import load_model
    from ipc.config import ServeConfig
    from ipc.messages import EngineRequest
    from ipc.sampling import SamplingParams

    bf16 = load_model(loaded.model_dir, "cuda", "bfloat16")
    config = ServeConfig(device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=1024,
                         max_num_batched_tokens=512, attention_backend=attention_backend)
    engine = EngineCore(config, loaded=bf16)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    out = engine.generate([EngineRequest(f"r{i}", p, sp) for i, p in enumerate(prompts)])
    # The first two steps (512 and 476 tokens: the prompts, chunked, then the rest of the longest beside four
    # decodes) replayed graphs of their layers (--cuda-graph-max-tokens), the rest decode graphs. Only where this
    # torch build runs flash varlen attention: without it, steps with prompt tokens run eagerly by design.
    if engine.runner.eager.varlen:
        assert [s for s in engine.runner.shapes if len(s) == 3], engine.runner.shapes
        assert engine.step_counts.graph_steps == engine.step_counts.steps
    bf16.model.set_attn_implementation("sdpa")
    gaps = []
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            tokens = out[(f"r{i}", 0)]
            logits = bf16.model(torch.tensor([p + tokens], device="cuda")).logits[0, len(p) - 1:-1].float()
            chosen = logits.gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]
            gaps += (logits.max(dim=1).values - chosen).tolist()
    exact = sum(g == 0 for g in gaps)
    print(f"bfloat16, {attention_backend}: {exact}/{len(gaps)} tokens are transformers' argmax, largest gap {max(gaps):.3f} logits")
    assert max(gaps) < 0.25 and exact >= 0.8 * len(gaps)


@pytest.mark.parametrize("kernel", ["flash", "triton"])
def test_varlen_step_matches_per_sequence_attention(kernel):
    """bfloat16: one varlen call (either kernel) for the whole step (a decode, fresh prompts, a chunk after cached context),
    K/V gathered by whole blocks with the real lengths in seqused_k, equals the batched decode plus SDPA run by run;
    so do the step padded for a CUDA graph of its layers (padding tokens and runs, max_q and max_k the graph's
    bounds) and a CUDA graph's decode step (rows padded to a bucket's blocks, padding rows)."""
    from types import SimpleNamespace

    from enginecore import attention, attention_plan
    from enginecore.kv_cache import KVCache, KVShape
    from enginecore.sequence import Sequence
    from enginecore.step_inputs import DecodePadding, MixedPadding, build_step_inputs
    from ipc.sampling import SamplingParams

    device = torch.device("cuda")
    varlen_kernel, why_not = attention_plan.kernel_named(kernel)
    why_not = why_not or attention_plan.kernel_fails(varlen_kernel, device, torch.bfloat16, 9, 3, 64)
    if why_not is not None:
        pytest.skip(f"{attention_plan.NAMES[kernel]} does not run here: {why_not}")
    attention.current.kernels = attention.VarlenKernels(decodes=varlen_kernel, mixed=varlen_kernel)
    g = torch.Generator(device=device).manual_seed(0)
    cache = KVCache(KVShape(1, 3, 64), 64, 16, torch.bfloat16, device)
    cache.tensor.normal_(generator=g)
    blocks = iter(torch.randperm(64).tolist())

    def seq(computed: int, total: int) -> Sequence:
        return Sequence(seq_id=0, request_id="x", client=None, index=0, token_ids=[0] * total, num_prompt_tokens=total,
                        sampling=SamplingParams(), priority=0, arrival=0, num_computed_tokens=computed,
                        block_table=[next(blocks) for _ in range(-(-total // 16))])

    mixed = [(seq(50, 51), 1), (seq(0, 30), 30), (seq(40, 60), 20), (seq(0, 90), 70)]
    decodes = [(seq(c - 1, c), 1) for c in (1, 16, 17, 100, 301)]
    module = SimpleNamespace(layer_idx=0)
    attention.current.kv_cache = cache
    # (entries, padding for varlen, padding for SDPA, tokens, real rows); the mixed step also padded as a graph of
    # its layers holds it (121 tokens in 128, 4 runs in 6, 16 blocks in 20).
    cases = [(mixed, None, None, 121, 121), (mixed, MixedPadding(128, 6, 20, cache.scratch_block), None, 128, 121),
             (decodes, DecodePadding(8, 32, cache.scratch_block), DecodePadding(8, 32, cache.scratch_block), 8, 5)]
    for entries, varlen_padding, sdpa_padding, tokens, real in cases:
        q = torch.randn(1, 9, tokens, 64, device=device, dtype=torch.bfloat16, generator=g)
        k = torch.randn(1, 3, tokens, 64, device=device, dtype=torch.bfloat16, generator=g)
        v = torch.randn(1, 3, tokens, 64, device=device, dtype=torch.bfloat16, generator=g)
        outs = []
        for varlen, padding in ((True, varlen_padding), (False, sdpa_padding)):
            rows = tokens if padding is not None else real
            attention.current.step = build_step_inputs(entries, 16, device, padding, varlen=varlen).attention
            assert (attention.current.step.varlen is not None) == varlen
            # Only the real rows: padding rows all write the scratch slot, and which write lands is up to the GPU.
            out = attention.paged_attention(module, q[:, :, :rows], k[:, :, :rows], v[:, :, :rows], None,
                                            scaling=0.125)[0][0, :real].float()
            outs.append(out)
        attention.current.step = None
        torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=2e-2)
    attention.current.kernels = attention.VarlenKernels()
