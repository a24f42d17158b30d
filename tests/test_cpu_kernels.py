"""Our C kernels of the CPU's lean forward (enginecore/csrc/layer_ops.c, decode_attention.c) against the torch ops
they stand in for, on shapes that reach every loop and tail (rows, heads per KV head, head sizes that are not
multiples of 8 or 32, contexts that end mid-block), as built for this CPU and as plain C; and the engine's greedy
tokens equal transformers' both with them and with torch's ops (the path of a machine without a compiler)."""
import ctypes
import functools
import os
import platform
import subprocess
import time

import pytest
import torch
from enginecore import attention, cpu_attention, native
from enginecore.cpu_layer_ops import CpuLayerOps, layer_ops
from torch.nn.functional import scaled_dot_product_attention as sdpa

from tests.test_engine_support import greedy_request, make_engine, prompts, reference_greedy  # noqa: F401

pytestmark = pytest.mark.skipif(layer_ops() is None or cpu_attention.kernel() is None,
                                reason="our CPU kernels cannot be built here (no C compiler)")


def plain_builds(tmp_path):
    """Each library built for this CPU, and (on x86) built without AVX: the vector code the compiler must lower
    another way, as on a CPU without it."""
    yield "native", layer_ops(), cpu_attention.kernel()
    cc = native.compiler()
    if platform.machine() not in ("x86_64", "AMD64") or cc is None:
        return
    libs = {}
    for name in ("layer_ops", "decode_attention"):
        path = tmp_path / f"{name}.so"
        subprocess.run([cc, "-O2", "-fopenmp", "-mno-avx", "-mno-avx2", "-mno-fma", "-shared", "-fPIC", "-o",
                        str(path), str(native.SOURCES / f"{name}.c")], check=True, timeout=120)
        libs[name] = ctypes.CDLL(str(path))
    yield "plain", CpuLayerOps(libs["layer_ops"]), cpu_attention.bind(libs["decode_attention"])


def test_rms_norm_silu_and_rope_equal_torch(tmp_path):
    gen = torch.Generator().manual_seed(0)
    for build, ops, _ in plain_builds(tmp_path):
        for rows, n in [(1, 576), (3, 13), (70, 64)]:  # 70: split among threads
            x = torch.randn(rows, 2 * n, generator=gen) * 3
            w = torch.randn(n, generator=gen)
            view = x[:, :n]  # rows apart: the norm reads a view
            assert torch.allclose(ops.rms_norm(view, w, 1e-5), torch.rms_norm(view, (n,), w, 1e-5), rtol=1e-5,
                                  atol=1e-5), build
            expected = torch.nn.functional.silu(x[:, :n]) * x[:, n:]
            assert torch.allclose(ops.silu_mul(x), expected, rtol=1e-5, atol=1e-5), build
        for tokens, heads, kv_heads, d in [(1, 9, 3, 64), (5, 4, 1, 10), (70, 8, 8, 128)]:
            check_rope_store(ops, gen, tokens, heads, kv_heads, d, build)


def check_rope_store(ops, gen, tokens, heads, kv_heads, d, build):
    from enginecore.lean_model import rope

    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen)
    angles = torch.rand(tokens, d // 2, generator=gen) * 6
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)
    sin = torch.cat([-angles.sin(), angles.sin()], dim=-1)  # the lean forward's table: first half negated
    slots = torch.randperm(4 * tokens, generator=gen)[:tokens]
    k_slots, v_slots = torch.zeros(4 * tokens, kv_heads, d), torch.zeros(4 * tokens, kv_heads, d)
    q = ops.rope_store(qkv, cos, sin, slots, k_slots, v_slots, heads, kv_heads)
    rotated = rope(qkv[:, :(heads + kv_heads) * d].view(tokens, heads + kv_heads, d), cos[:, None], sin[:, None])
    assert torch.allclose(q, rotated[:, :heads], rtol=1e-5, atol=1e-5), build
    assert torch.allclose(k_slots[slots], rotated[:, heads:], rtol=1e-5, atol=1e-5), build
    assert torch.equal(v_slots[slots], qkv[:, (heads + kv_heads) * d:].view(tokens, kv_heads, d)), build
    untouched = torch.ones(4 * tokens, dtype=torch.bool)
    untouched[slots] = False
    assert not k_slots[untouched].any() and not v_slots[untouched].any(), build


@pytest.mark.parametrize("rows, heads, kv_heads, d, block_size, lengths", [
    (1, 9, 3, 64, 16, [64]),
    (1, 9, 3, 64, 16, [1]),
    (4, 4, 4, 80, 16, [1, 17, 33, 50]),  # d: two vectors of 32 and one of 8, then nothing left
    (3, 8, 2, 20, 5, [7, 3, 11]),  # d with a tail past the last 8; blocks of 5 (not a multiple of 4)
    (40, 32, 8, 128, 16, list(range(1, 401, 10))),  # split among threads
])
def test_decode_attention_equals_sdpa_over_the_gathered_context(tmp_path, rows, heads, kv_heads, d, block_size,
                                                                lengths):
    gen = torch.Generator().manual_seed(rows)
    blocks_each = -(-max(lengths) // block_size)
    layer = torch.randn(2, rows * blocks_each + 1, block_size, kv_heads, d, generator=gen)
    tables = torch.randperm(rows * blocks_each, generator=gen).view(rows, blocks_each)
    q = torch.randn(rows, heads, d, generator=gen)
    expected = torch.empty(rows, heads, d)
    for b, length in enumerate(lengths):
        k = layer[0][tables[b]].flatten(0, 1)[:length].transpose(0, 1)  # [kv_heads, length, d]
        v = layer[1][tables[b]].flatten(0, 1)[:length].transpose(0, 1)
        expected[b] = sdpa(q[b].view(kv_heads, heads // kv_heads, d), k, v, scale=0.3).reshape(heads, d)
    kv = (layer[0].data_ptr(), layer[1].data_ptr(), block_size, kv_heads)
    for build, _, lib in plain_builds(tmp_path):
        got = cpu_attention.decode(q, kv, tables.reshape(-1).contiguous(), torch.tensor(lengths), 0.3, lib)
        assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5), (build, (got - expected).abs().max())


def test_decode_attention_reads_a_query_inside_a_wider_row():
    """The lean forward hands the rotated q of each row inside [q heads | k heads] rows: its heads contiguous,
    the rows further apart."""
    layer = torch.randn(2, 3, 16, 1, 8)
    wide = torch.randn(2, 5, 8)
    q = wide[:, :4]
    kv = (layer[0].data_ptr(), layer[1].data_ptr(), 16, 1)
    tables, lengths = torch.tensor([0, 1, 2, 0]), torch.tensor([20, 5])
    apart = cpu_attention.decode(q, kv, tables, lengths, 1.0, cpu_attention.kernel())
    assert torch.equal(apart, cpu_attention.decode(q.contiguous(), kv, tables, lengths, 1.0, cpu_attention.kernel()))


def test_greedy_tokens_equal_transformers_with_torchs_ops_too(prompts, monkeypatch):
    """A machine without a C compiler runs the lean forward on torch's ops: the engine's tokens stay
    transformers'."""
    monkeypatch.setattr(cpu_attention, "kernel", lambda: None)
    gathers = []
    gather = attention._gather_blocks
    monkeypatch.setattr(attention, "_gather_blocks", lambda *a: gathers.append(1) or gather(*a))
    engine = make_engine(enable_prefix_caching=False)
    engine.runner.lean_model.cpu_ops = None
    try:
        out = engine.generate([greedy_request(f"r{i}", p, 12) for i, p in enumerate(prompts)])
    finally:
        engine.runner.lean_model.cpu_ops = layer_ops()  # the model's lean forward is shared between engines
    for i, prompt in enumerate(prompts):
        assert out[(f"r{i}", 0)] == reference_greedy(prompt, 12), f"prompt {i}"
    assert gathers, "torch's decode path did not run"


def test_the_cpu_engine_runs_our_kernels():
    engine = make_engine()
    assert engine.runner.lean_model.cpu_ops is layer_ops()
    calls = []
    decode = cpu_attention.decode
    cpu_attention.decode = lambda *a: calls.append(a[0].shape) or decode(*a)
    try:
        engine.generate([greedy_request("one", [1, 2, 3, 4, 5], 3)])
    finally:
        cpu_attention.decode = decode
    assert calls and all(shape[0] == 1 for shape in calls)


def test_a_decode_step_in_one_call_gives_the_layer_by_layer_logits_bit_for_bit(prompts, monkeypatch):
    """csrc/decode_layers.c runs the same kernels in the same order as the lean forward's layers: every step's
    logits are equal, not just close. The embedded model's layers are a GGUF's Q4_1 blocks, kept in 4-bit codes;
    the same codes in 8 bits give the same logits too, in one call and layer by layer."""
    from enginecore.cpu_decode_layers import CpuDecodeLayers
    from enginecore.cpu_int8 import PackedInt8Linear
    from enginecore.cpu_setup import with_cpu_kernels
    from enginecore.lean_model import LeanLlama

    engine = make_engine(quantization="int8", enable_prefix_caching=False, max_num_seqs=4)
    four = engine.runner.lean_model
    if four.cpu_decode_layers is None:
        pytest.skip("int8's products are not our kernel's here (oneDNN's W8A8 timed faster)")
    assert [k.bits for k in four.linears()] == [4] * (len(four.linears()) - 1) + [8]  # the LM head: Q8_0's range
    eight = with_cpu_kernels(LeanLlama(engine.loaded.model, functools.partial(PackedInt8Linear, bits=8)))
    assert {k.bits for k in eight.linears()} == {8} and eight.cpu_decode_layers is not None
    calls = []
    call = CpuDecodeLayers.__call__
    monkeypatch.setattr(CpuDecodeLayers, "__call__", lambda *a: calls.append(a[1].shape[0]) or call(*a))
    forward = engine.runner.forward
    logits: list[torch.Tensor] = []
    monkeypatch.setattr(engine.runner, "forward", lambda inputs: logits.append(forward(inputs).clone()) or logits[-1])
    runs = []
    try:
        for lean in (four, eight):
            engine.runner.lean_model = lean
            fused = lean.cpu_decode_layers
            for one_call in (True, False):
                lean.cpu_decode_layers = fused if one_call else None
                logits.clear()
                out = engine.generate([greedy_request(f"r{i}", p, 10) for i, p in enumerate(prompts[:6])])
                runs.append((out, list(logits)))
            lean.cpu_decode_layers = fused
    finally:
        engine.runner.lean_model = four  # the model's lean forward is shared between engines
    (out_one, logits_one) = runs[0]
    for out, logits_other in runs[1:]:
        assert out == out_one
        assert len(logits_other) == len(logits_one) > 10
        assert all(torch.equal(a, b) for a, b in zip(logits_one, logits_other))
    assert len(calls) > 10 and max(calls) == 4  # each one-call run's decode steps, up to 4 rows, went through it


def test_a_machine_without_a_compiler_serves_on_torchs_ops(tmp_path):
    """No C compiler: the group starts and answers, each kernel left out with one line in the log saying why."""
    import shutil

    from openai import OpenAI

    from tests.supervise_process import Supervise, model_cache_without_native_builds

    cache = tmp_path / "cache"
    env = {"XDG_CACHE_HOME": model_cache_without_native_builds(cache), "CC": shutil.which("false") or "/bin/false"}
    with Supervise(env=env) as server:
        client = OpenAI(base_url=server.base_url, api_key="unused")
        answer = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=8, temperature=0,
                                                messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in answer.choices[0].message.content
        log = server.log()
    assert "could not build int8_linear.c" in log and "could not build layer_ops.c" in log
    assert "decode attention by torch" in log
    assert "Traceback" not in log
    assert not (cache / "supervise" / "native").exists() or not list((cache / "supervise" / "native").glob("*.so"))


def test_every_kernel_is_built_before_the_group_is_ready(tmp_path):
    """A first start builds the kernels while the engine starts, not in its step loop: the decode attention kernel
    was built by the first step with decode rows, a second or two of the compiler that every stream in flight
    waited out."""
    from openai import OpenAI

    from tests.supervise_process import Supervise, model_cache_without_native_builds

    cache = tmp_path / "cache"
    native_dir = cache / "supervise" / "native"
    with Supervise(env={"XDG_CACHE_HOME": model_cache_without_native_builds(cache)}) as server:
        built = sorted(path.name.split("-")[0] for path in native_dir.glob("*.so"))
        assert "decode_attention" in built and "layer_ops" in built, built
        client = OpenAI(base_url=server.base_url, api_key="unused")
        answer = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=8, temperature=0,
                                                messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in answer.choices[0].message.content
        assert sorted(path.name.split("-")[0] for path in native_dir.glob("*.so")) == built
        log = server.log()
    assert log.count("built decode_attention.c") == 1
    assert log.index("built decode_attention.c") < log.index("engine core(s) ready")


def test_the_installed_package_builds_every_kernel(tmp_path):
    """What pip installs holds every source and header the kernels are built from: the wheel left out csrc/vec8.h,
    so an installed supervise could build only the int8 product and ran the rest on torch's ops."""
    import shutil
    import sys
    import zipfile

    root = native.SOURCES.parent.parent
    source = tmp_path / "source"  # a copy: building in the checkout would leave build/ there
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, source / name)
    for package in ("supervisor", "apiserver", "enginecore", "ipc"):
        shutil.copytree(root / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "wheel"), str(source)], check=True, timeout=300, capture_output=True)
    installed = tmp_path / "installed"
    zipfile.ZipFile(next((tmp_path / "wheel").glob("supervise-*.whl"))).extractall(installed)
    kernels = sorted(path.stem for path in native.SOURCES.glob("*.c"))
    probe = ("import enginecore, enginecore.native as n; assert enginecore.__file__.startswith(%r); "
             "[n.library(name) for name in %r]; print('built')" % (str(installed), kernels))
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={"PATH": os.environ["PATH"], "PYTHONPATH": str(installed),
                               "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert done.stdout.strip() == "built", done.stderr[-2000:]
    assert sorted(path.name.split("-")[0] for path in (tmp_path / "cache" / "supervise" / "native").glob("*.so")) \
        == kernels


def test_a_step_whose_rows_need_no_logits_runs_on_our_kernels(prompts):
    """A prompt longer than a step's token budget is computed in chunks, and a step of only a chunk that does not
    end its prompt samples nothing: its LM head multiplies no row. Our int8 kernel read a row there anyway and the
    engine died of a segmentation fault (any prompt over --max-num-batched-tokens under the default int8)."""
    engine = make_engine(quantization="int8", max_num_batched_tokens=64, enable_prefix_caching=False)
    long_prompt = max(prompts, key=len)
    assert len(long_prompt) > 2 * 64
    out = engine.generate([greedy_request("long", long_prompt, 4)])
    assert len(out[("long", 0)]) == 4
    lean = engine.runner.lean_model
    empty = torch.empty(0, lean.head.in_features)
    assert lean.head(empty).shape == (0, lean.head.out_features)
    assert engine.runner.lean_model.cpu_ops.rms_norm(empty, lean.final_norm, 1e-5).shape == empty.shape


@pytest.fixture(scope="module")
def small_budget():
    """The default group (int8 by our kernel where it runs) with a small step budget: long prompts go in chunks."""
    from tests.supervise_process import Supervise

    with Supervise("--max-num-batched-tokens", "64") as server:
        yield server


def test_a_prompt_past_the_step_budget_is_answered_by_the_default_group(small_budget):
    """Through the group: a prompt of many chunks answered, and the group still up for the next request."""
    from openai import OpenAI

    client = OpenAI(base_url=small_budget.base_url, api_key="unused")
    model = client.models.list().data[0].id
    long = client.completions.create(model=model, prompt="the sea and the sky " * 120, max_tokens=4, temperature=0)
    assert long.usage.prompt_tokens > 4 * 64 and long.usage.completion_tokens == 4
    again = client.chat.completions.create(model=model, max_tokens=8, temperature=0,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in again.choices[0].message.content
    assert "Segmentation" not in small_budget.log() and "Traceback" not in small_budget.log()


def test_a_long_prompt_does_not_hold_up_a_short_request_for_its_whole_prefill(small_budget):
    """A long prompt took every step's budget until its prefill was done, and a short chat that came after it waited
    that long (40 s behind 8,000 tokens at the default budget on this CPU). With another request beside it, its
    chunk is a quarter of the budget (--long-prefill-token-threshold): the chat is answered while the long prompt
    is still being read."""
    import threading

    from openai import OpenAI

    client = OpenAI(base_url=small_budget.base_url, api_key="unused", timeout=120)
    model = client.models.list().data[0].id
    done: dict[str, float] = {}

    def long_prompt():
        client.completions.create(model=model, prompt="the sea and the sky " * 600, max_tokens=1)
        done["long"] = time.monotonic()

    reader = threading.Thread(target=long_prompt)
    reader.start()
    time.sleep(0.5)  # its prefill under way: some 3,000 tokens, 64 a step alone
    client.chat.completions.create(model=model, max_tokens=5, temperature=0,
                                   messages=[{"role": "user", "content": "Say hi."}])
    done["short"] = time.monotonic()
    reader.join(120)
    assert done["short"] < done["long"], done
