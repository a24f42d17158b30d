"""The tiny Llama-shaped model (tests/models/tiny-llama, random weights) in an engine core on the CPU, greedy: the
tokens it makes for some prompts, with a hook to change how the engine computes before it runs (tests that run
a kernel's path through the whole engine and compare tokens with the default path)."""
import os
from typing import Callable

TINY = os.path.join(os.path.dirname(__file__), "models", "tiny-llama")


def greedy_tokens(prompts: list[list[int]], max_tokens: int, setup: Callable | None = None) -> dict:
    """{(request_id, 0): tokens} for `prompts` (request ids r0, r1, ...); `setup(engine)` runs first. Chunks of 48
    tokens a step and 8 sequences: long prompts go in chunks beside decodes, then the steps are decodes."""
    from enginecore.engine import EngineCore
    from enginecore.loader import load_model
    from ipc.config import ServeConfig
    from ipc.messages import EngineRequest
    from ipc.sampling import SamplingParams

    config = ServeConfig(model=TINY, device="cpu", dtype="float32", load_format="dummy", max_num_batched_tokens=48,
                         max_num_seqs=8, kv_cache_memory=16 * 2**20)
    engine = EngineCore(config, loaded=load_model(TINY, "cpu", "float32", load_format="dummy"))
    if setup is not None:
        setup(engine)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return engine.generate([EngineRequest(f"r{i}", p, sp) for i, p in enumerate(prompts)])
