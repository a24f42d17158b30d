"""One request must not hold every slot of an engine: --max-num-seqs holds for a request's forked choices too, and
the sequences of a request with many prompts and choices take turns with the requests that come after it.

Before: `{"prompt": ["hi"] * 256, "n": 128}` (2 KB) ran 128 sequences per prompt in every step whatever
--max-num-seqs said (a GPU engine's sampler is sized by it), and another client's short request waited for all
32,768 of them (66 s).
"""
from __future__ import annotations

import asyncio
import re
import time

import httpx

from tests.tiny_engine import TINY


def _engine(max_num_seqs: int):
    from enginecore.engine import EngineCore
    from enginecore.loader import load_model
    from ipc.config import ServeConfig

    config = ServeConfig(model=TINY, device="cpu", dtype="float32", load_format="dummy",
                         max_num_batched_tokens=512, max_num_seqs=max_num_seqs, kv_cache_memory=64 * 2**20)
    return EngineCore(config, loaded=load_model(TINY, "cpu", "float32", load_format="dummy"))


def _request(request_id: str, n: int, max_tokens: int, ordinal: int = 0, **sampling):
    from ipc.messages import EngineRequest
    from ipc.sampling import SamplingParams

    prompt = [(7 * len(request_id) + i) % 200 + 1 for i in range(37)]  # not a whole number of blocks
    params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, **sampling)
    return EngineRequest(request_id, prompt, params, ordinal=ordinal)


def _run(engine, requests, on_step=None) -> dict[tuple[str, int], list[int]]:
    tokens: dict[tuple[str, int], list[int]] = {}
    for request in requests:
        assert engine.add_request(request) == []
    steps = 0
    while engine.has_work():
        for _, out in engine.step():
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
        steps += 1
        if on_step is not None:
            on_step(engine, steps, tokens)
    return tokens


def test_forked_choices_keep_to_max_num_seqs_and_make_the_same_tokens():
    most = []
    engine = _engine(max_num_seqs=3)
    capped = _run(engine, [_request("seeded", n=8, max_tokens=6, seed=11, temperature=1.0),
                           _request("greedy", n=5, max_tokens=6, temperature=0.0)],
                  on_step=lambda e, steps, tokens: most.append(len(e.scheduler.running)))
    assert max(most) <= 3, f"{max(most)} sequences ran in one step, --max-num-seqs is 3"
    # The same requests where every choice runs at once beside its parent: the choices that waited for a slot (and
    # computed their prompt's last block themselves) make the same tokens.
    free = _run(_engine(max_num_seqs=16), [_request("seeded", n=8, max_tokens=6, seed=11, temperature=1.0),
                                           _request("greedy", n=5, max_tokens=6, temperature=0.0)])
    assert sorted(capped) == sorted(free) == [("greedy", i) for i in range(5)] + [("seeded", i) for i in range(8)]
    assert all(len(t) == 6 for t in capped.values())
    assert capped == free
    assert len({tuple(capped[("greedy", i)]) for i in range(5)}) == 1  # greedy choices agree
    assert len({tuple(capped[("seeded", i)]) for i in range(8)}) > 1  # seeded ones are drawn apart


def test_a_request_of_many_prompts_and_choices_takes_turns_with_later_ones():
    engine = _engine(max_num_seqs=4)
    # 8 prompts with n=16 each: 128 sequences of 8 tokens, 256 steps of 4 at a time.
    hog = [_request(f"hog-{i}", n=16, max_tokens=8, ordinal=16 * i) for i in range(8)]
    came: dict[str, int] = {}
    done: dict[str, int] = {}

    def on_step(e, steps, tokens):
        if steps == 3:  # the hog's first sequences run: a short request comes
            assert e.add_request(_request("late", n=1, max_tokens=8)) == []
            came["late"] = steps
        if "late" in came and "late" not in done and len(tokens.get(("late", 0), [])) == 8:
            done["late"] = steps
        assert len(e.scheduler.running) <= 4

    tokens = _run(engine, hog, on_step=on_step)
    assert len(tokens) == 129 and all(len(t) == 8 for t in tokens.values())
    waited = done["late"] - came["late"]
    # It waits for one slot to free (at most 8 steps with 8-token sequences), then makes its 8 tokens: not the
    # 250 steps of the hog's sequences that came before it.
    assert waited <= 24, f"the late request took {waited} steps of the hog's ~256"


def test_an_api_request_of_many_choices_shares_the_engine(start_supervise):
    """Through the group, at --max-num-seqs 4: a completions request of 4 prompts with n=16 (64 sequences of 48
    tokens: long enough that the chat's 0.2 s head start stays a small part of it on a fast CPU, where 16 tokens
    each took 0.37 s in all), and a chat that comes just after it. The chat is answered while the big request still runs (it waited
    for all of it), and no step ran more sequences than --max-num-seqs (the rank's running gauge in /metrics)."""
    server = start_supervise("--model", TINY, "--load-format", "dummy", "--max-model-len", "256",
                             "--max-num-seqs", "4")

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            running: list[int] = []
            stop = asyncio.Event()

            async def watch():
                while not stop.is_set():
                    text = (await client.get("/metrics")).text
                    running.extend(int(float(v)) for v in
                                   re.findall(r'engine_num_requests_running\{[^}]*\} ([0-9.e+]+)', text))
                    await asyncio.sleep(0.02)

            async def big():
                r = await client.post("/v1/completions", json={
                    "model": model, "prompt": ["one", "two", "three", "four"], "n": 16, "max_tokens": 48,
                    "temperature": 1.0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                assert len(r.json()["choices"]) == 64
                return time.monotonic() - started

            async def small():
                await asyncio.sleep(0.2)  # the big request's prompts are in
                r = await client.post("/v1/chat/completions", json={
                    "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                    "ignore_eos": True})
                assert r.status_code == 200, r.text
                return time.monotonic()

            watcher = asyncio.create_task(watch())
            started = time.monotonic()
            big_task = asyncio.create_task(big())
            small_done = await small()
            big_seconds = await big_task
            stop.set()
            await watcher
            return running, big_seconds, small_done - started

    running, big_seconds, small_done = asyncio.run(scenario())
    assert running and max(running) <= 4, f"{max(running)} sequences ran at once, --max-num-seqs is 4"
    # Under first come first served the chat waited for all 64 sequences (it ended with the big request, or after).
    assert small_done < 0.6 * big_seconds, \
        f"the chat was answered {small_done:.2f} s in, the big request {big_seconds:.2f} s in: it waited for all of it"


def test_choices_aborted_while_they_wait_for_a_slot_end_and_free_everything():
    from ipc.messages import FinishReason

    engine = _engine(max_num_seqs=2)
    assert engine.add_request(_request("r", n=8, max_tokens=6, temperature=1.0, seed=3)) == []
    ends: dict[int, str] = {}
    tokens: dict[int, int] = {}
    for step in range(1000):
        if not engine.has_work():
            break
        outputs = [out for _, out in engine.step()]
        if step == 2:  # choices 0 and 1 run, 2-7 wait for their slots
            assert engine.scheduler.num_waiting == 6
            outputs += engine.abort(["r"], None, [5, 6])
        for out in outputs:
            tokens[out.index] = tokens.get(out.index, 0) + len(out.new_token_ids)
            if out.finish_reason is not None:
                ends[out.index] = out.finish_reason
    assert ends == {i: FinishReason.ABORT if i in (5, 6) else FinishReason.LENGTH for i in range(8)}
    assert [tokens[i] for i in range(8)] == [6, 6, 6, 6, 6, 0, 0, 6]
    assert engine.scheduler.num_waiting == 0 and not engine.scheduler.running and not engine.requests
    assert engine.pool.num_free == engine.pool.num_blocks
