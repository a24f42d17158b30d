"""`supervise --grpc`: the VllmEngine service as a grpcio client generated from the published proto sees it.

One group for the module: the simulated engine (it emits the tokens of a fixed sentence, which the embedded
model's tokenizer decodes), two gRPC API servers, metrics on their own port.
"""
import hashlib
import io
import json
import logging
import threading
import time
import zipfile

import grpc
import httpx
import psutil
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import common_pb2
from tokenizers import Tokenizer

from tests.grpc_support import SERVICE, GrpcSupervise, error_of, generate_request, health_status
from tests.hostile_grammars import gbnf_chains, ref_chain, rule_chain
from tests.supervise_process import title_of

SENTENCE_START = "Paris is the capital of France."
PROMPT = [1, 9690, 198, 2683, 359, 253]


@pytest.fixture(scope="module")
def group():
    with GrpcSupervise("--model", "sim:10", "--api-server-count", "2", "--metrics-port", "0") as server:
        yield server


@pytest.fixture(scope="module")
def stub(group):
    return group.stub()


@pytest.fixture(scope="module")
def tokenizer(stub):
    """The tokenizer this server streams (GetTokenizer), loaded as the gateway would load it."""
    chunks = list(stub.GetTokenizer(common_pb2.GetTokenizerRequest()))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert all(not c.sha256 for c in chunks[:-1])
    with zipfile.ZipFile(io.BytesIO(data)) as bundle:
        assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(bundle.namelist())
        return Tokenizer.from_str(bundle.read("tokenizer.json").decode())


def engine_running(stub) -> int:
    return stub.GetLoads(pb.GetLoadsRequest()).loads[0].num_running_reqs


def wait_engine_idle(stub, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while engine_running(stub):
        assert time.monotonic() < deadline, "the engine still runs requests"
        time.sleep(0.05)


def test_streamed_generate_sends_deltas_then_a_complete_per_sample(stub, tokenizer):
    responses = list(stub.Generate(generate_request(PROMPT, "stream-1", stream=True, max_tokens=6, n=2,
                                                    ignore_eos=True, logprobs=2, prompt_logprobs=1)))
    for index in (0, 1):
        chunks = [r.chunk for r in responses if r.HasField("chunk") and r.chunk.index == index]
        (complete,) = [r.complete for r in responses if r.HasField("complete") and r.complete.index == index]
        streamed = [t for c in chunks for t in c.token_ids]
        assert len(streamed) == 6 and all(c.completion_tokens == len(c.token_ids) for c in chunks)
        assert list(complete.output_ids) == streamed
        assert tokenizer.decode(streamed).startswith("Paris is the capital")
        assert (complete.finish_reason, complete.prompt_tokens, complete.completion_tokens) == ("length", 6, 6)
        assert [len(c.output_logprobs.top_logprobs[0].values) for c in chunks] == [2] * len(chunks)
        assert [c.output_logprobs.token_ids[0] for c in chunks] == streamed
        first = chunks[0].input_logprobs
        assert list(first.token_ids) == PROMPT and len(first.token_logprobs) == len(PROMPT)
        assert not first.token_logprobs[0].HasField("value") and first.token_logprobs[1].HasField("value")
        assert all(not c.HasField("input_logprobs") for c in chunks[1:])


def test_whole_generate_sends_one_complete_per_sample(stub, tokenizer):
    responses = list(stub.Generate(generate_request(PROMPT, max_tokens=5, n=3, logprobs=0)))
    assert all(r.HasField("complete") for r in responses)
    assert sorted(r.complete.index for r in responses) == [0, 1, 2]
    for r in responses:
        assert len(r.complete.output_ids) == 5 and r.complete.finish_reason == "length"
        assert list(r.complete.output_logprobs.token_ids) == list(r.complete.output_ids)
        assert tokenizer.decode(list(r.complete.output_ids)) == "Paris is the capital of"


def test_valid_constraints_are_taken(stub):
    """Compiled and handed to the engine (the simulated one ignores them: tests/test_grpc_gateway.py checks the
    real model's output under them)."""
    for constraint in (dict(json_schema='{"type": "object"}'), dict(json_object=True), dict(regex="[a-z]+"),
                       dict(choice=pb.ChoiceConstraint(choices=["yes", "no"])), dict(grammar='start: "a"+')):
        (response,) = stub.Generate(generate_request(PROMPT, max_tokens=2, **constraint))
        assert response.complete.finish_reason == "length", constraint


def grammar_check_seconds(stub, grammar: str) -> float:
    """How long a call with `grammar` (not seen before) takes here, its checker already started."""
    start = time.monotonic()
    (response,) = stub.Generate(generate_request(PROMPT, max_tokens=2, grammar=grammar))
    assert response.complete.finish_reason == "length"
    return time.monotonic() - start


def test_a_call_cancelled_in_its_grammar_check_leaves_the_next_calls_their_own_answers(stub):
    """A client past its deadline while its grammar is built: the checker's answer to it was read by the next call,
    which took another client's grammar (or failed INTERNAL), and so on for every call after it."""
    # One channel, one API server: start its checker, then find how many chains of GBNF rules this machine
    # converts in 0.3 s or more (2 took 0.3 s on one CPU; a fixed 0.3 s deadline once fell after the end of a
    # conversion on a faster one), so that the deadline below falls well inside the conversion of the next ones,
    # as long and not cached (a comment tells them apart), on any CPU.
    grammar_check_seconds(stub, gbnf_chains(1, 1))
    chains = 2
    while (seconds := grammar_check_seconds(stub, gbnf_chains(chains, 600))) < 0.3:
        assert chains < 64, f"{chains} chains converted in {seconds:.3f} s: too fast for a deadline inside it"
        chains *= 2
    deadline = min(seconds, grammar_check_seconds(stub, gbnf_chains(chains, 600) + "# again\n")) / 4
    for call in range(2):
        grammar = gbnf_chains(chains, 600) + f"# cancelled {call}\n"
        error = error_of(lambda: stub.Generate(generate_request(PROMPT, max_tokens=2, grammar=grammar),
                                               timeout=deadline))
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        error = error_of(lambda: stub.Generate(generate_request(PROMPT, json_schema='{"type": 3}')))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "json_schema" in error.details(), error.details()
        (response,) = stub.Generate(generate_request(PROMPT, max_tokens=2, regex="[0-9]+"))
        assert response.complete.finish_reason == "length"


def test_eos_stop_token_and_prompt_only(stub, tokenizer):
    (eos,) = stub.Generate(generate_request(PROMPT, max_tokens=200))
    assert eos.complete.finish_reason == "stop" and tokenizer.decode(list(eos.complete.output_ids)).startswith(
        SENTENCE_START)
    the = tokenizer.encode(" the", add_special_tokens=False).ids[0]
    (stopped,) = stub.Generate(generate_request(PROMPT, max_tokens=50, stop_token_ids=[the]))
    assert stopped.complete.finish_reason == "stop" and stopped.complete.matched_token_id == the
    assert stopped.complete.output_ids[-1] == the
    (prompt_only,) = stub.Generate(generate_request(PROMPT, max_tokens=0, prompt_logprobs=0))
    assert len(prompt_only.complete.output_ids) == 0 and prompt_only.complete.finish_reason == "length"
    assert len(prompt_only.complete.input_logprobs.token_logprobs) == len(PROMPT)


BAD_REQUESTS = [
    ("empty prompt", generate_request([], max_tokens=2), "is empty"),
    ("text input", pb.GenerateRequest(text="hello"), "needs a tokenizer"),
    ("no input", pb.GenerateRequest(), "no input"),
    ("id outside the vocabulary", generate_request([1, 49152], max_tokens=2), "outside the vocabulary"),
    ("prompt longer than the model", generate_request([5] * 9000, max_tokens=2), "maximum context length"),
    ("max_tokens 0 without prompt logprobs", generate_request(PROMPT, max_tokens=0), "max_tokens"),
    ("max_tokens huge", generate_request(PROMPT, max_tokens=4_000_000_000), "maximum context length"),
    ("n 1000", generate_request(PROMPT, max_tokens=2, n=1000), "`n` is 1000"),
    ("a whole answer too large for its logprobs", generate_request(PROMPT, max_tokens=4000, n=128, logprobs=20),
     "10,752,000 logprob entries"),
    ("schema that is not JSON", generate_request(PROMPT, json_schema="{not json"), "`sampling_params.json_schema`"),
    ("schema of the wrong type", generate_request(PROMPT, json_schema='{"type": 3}'), "`sampling_params.json_schema`"),
    ("schema nested 3000 deep", generate_request(PROMPT, json_schema='{"type": "object", "properties": {"a": ' * 3000
                                                 + "{}" + "}}" * 3000), "nested too deeply"),
    ("regex that does not compile", generate_request(PROMPT, regex="(a"), "`sampling_params.regex`"),
    # Each crashed llguidance's compiler (a stack overflow), and with it the API server, before it ran in a process
    # of its own (apiserver/grammar_checker.py); the next call must find the same server serving.
    ("schema whose $refs chain 1,000 deep", generate_request(PROMPT, json_schema=json.dumps(ref_chain(1000))),
     "crashed the grammar compiler"),
    ("grammar whose rules chain 4,000 deep", generate_request(PROMPT, grammar=rule_chain(4000)),
     "crashed the grammar compiler"),
    ("no choices", generate_request(PROMPT, choice=pb.ChoiceConstraint(choices=[])), "list of choices is empty"),
    ("grammar that does not parse", generate_request(PROMPT, grammar="start: (("), "`sampling_params.grammar`"),
    ("structural tag", generate_request(PROMPT, structural_tag="{}"), "`structural_tag` are not supported"),
    ("logit bias outside the vocabulary", generate_request(PROMPT, logit_bias={10**6: 1.0}), "logit_bias"),
    ("logit bias past 100", generate_request(PROMPT, logit_bias={5: 100.5}), "logit_bias"),
    ("logit bias NaN", generate_request(PROMPT, logit_bias={5: float("nan")}), "logit_bias"),
    ("logit bias of too many tokens", generate_request(PROMPT, logit_bias={i: 1.0 for i in range(1025)}),
     "--max-logit-bias-entries"),
    ("all logprobs", generate_request(PROMPT, logprobs=-1), "logprobs"),
    ("temperature", generate_request(PROMPT, temperature=-1.0), "temperature"),
    ("top_p", generate_request(PROMPT, top_p=1.5), "top_p"),
    ("stop token outside the vocabulary", generate_request(PROMPT, stop_token_ids=[10**6]), "stop_token_ids"),
    ("min_tokens over max_tokens", generate_request(PROMPT, max_tokens=2, min_tokens=5), "min_tokens"),
    ("images", pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=PROMPT),
                                  mm_inputs=pb.MultimodalInputs(im_token_id=3)), "text only"),
    ("rank that does not exist", pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=PROMPT),
                                                    data_parallel_rank=3), "rank 3 is not served here"),
]


@pytest.mark.parametrize("what,request_message,message", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_is_invalid_argument_and_the_server_keeps_serving(stub, what, request_message, message):
    error = error_of(lambda: stub.Generate(request_message))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, error)
    assert message in error.details(), (what, error.details())
    (ok,) = stub.Generate(generate_request(PROMPT, max_tokens=2))
    assert len(ok.complete.output_ids) == 2


# Raw bytes: not a protobuf message at all; a field GenerateRequest does not have (number 125); a constraint
# type SamplingParams does not have (number 29, in `sampling_params`, field 4).
@pytest.mark.parametrize("raw,message", [
    (b"\xff\xff\xff", "malformed request message"),
    (bytes(pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=PROMPT)).SerializeToString()) + b"\xe8\x07\x01",
     "field number(s) 125"),
    (b"\x22\x03\xe8\x01\x01" + bytes(pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=PROMPT))
                                     .SerializeToString()), "sampling_params holds field number(s) 29"),
], ids=["not protobuf", "unknown field", "unknown constraint type"])
def test_malformed_and_unknown_messages_are_invalid_argument(group, stub, raw, message):
    channel = group.channel()
    generate = channel.unary_stream(f"/{SERVICE}/Generate", request_serializer=lambda b: b,
                                    response_deserializer=pb.GenerateResponse.FromString)
    error = error_of(lambda: generate(raw))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and message in error.details(), error
    (ok,) = stub.Generate(generate_request(PROMPT, max_tokens=1))
    assert ok.complete.finish_reason == "length"


def test_truncate_prompt_tokens_keeps_the_last_tokens_and_checks_only_those(stub):
    long_prompt = PROMPT * 50
    (kept,) = stub.Generate(generate_request(long_prompt, max_tokens=1, truncate_prompt_tokens=4))
    assert kept.complete.prompt_tokens == 4
    (whole,) = stub.Generate(generate_request(long_prompt, max_tokens=1, truncate_prompt_tokens=-1))
    assert whole.complete.prompt_tokens == len(long_prompt)
    # An id outside the vocabulary in the part dropped is not the request's; in the part kept it is refused.
    (served,) = stub.Generate(generate_request([10**6, *PROMPT], max_tokens=1, truncate_prompt_tokens=3))
    assert served.complete.prompt_tokens == 3
    error = error_of(lambda: stub.Generate(generate_request([*PROMPT, 10**6], max_tokens=1,
                                                            truncate_prompt_tokens=3)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside the vocabulary" in error.details()
    error = error_of(lambda: stub.Generate(generate_request(PROMPT, max_tokens=1, truncate_prompt_tokens=0)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "truncate_prompt_tokens" in error.details()


def test_prompts_of_millions_of_ids_sent_at_once_are_refused_without_piling_up_in_memory(group, stub):
    """32 calls of 3.9 million ids each (7.8 MB, under --max-request-body-bytes) at once: each is refused by its
    length alone, or, while the server holds --max-large-request-bodies-mb (32) of such messages, before it is
    parsed at all. Made into Python lists, 16 had held 3.2 GB of an API server; checked by their length but all
    parsed as they came (some 35 MB each, grpcio parses every message as it arrives), 64 held 2.3 GB."""
    huge = generate_request([(i * 7919) % 16000 + 200 for i in range(3_900_000)], max_tokens=1)
    servers = [psutil.Process(pid) for pid in group.api_server_pids()]
    peak, errors, done = [0], [], threading.Event()

    def watch_memory():
        while not done.is_set():
            peak[0] = max(peak[0], sum(p.memory_info().rss for p in servers))
            time.sleep(0.02)

    def call():
        with group.channel() as channel:
            errors.append(error_of(lambda: pb_grpc.VllmEngineStub(channel).Generate(huge, timeout=60)))

    watcher = threading.Thread(target=watch_memory)
    watcher.start()
    callers = [threading.Thread(target=call) for _ in range(32)]
    for thread in callers:
        thread.start()
    for thread in callers:
        thread.join()
    done.set()
    watcher.join()
    too_long = [e for e in errors if e.code() == grpc.StatusCode.INVALID_ARGUMENT]
    held_off = [e for e in errors if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert len(too_long) + len(held_off) == 32 and too_long, [e.code() for e in errors]
    assert all("3900000 input tokens" in e.details() for e in too_long), too_long[0].details()
    assert all("--max-large-request-bodies-mb" in e.details() for e in held_off), held_off[0].details()
    assert peak[0] < 600e6, f"the API servers held {peak[0] / 1e6:.0f} MB"
    (ok,) = stub.Generate(generate_request(PROMPT, max_tokens=1))
    assert ok.complete.finish_reason == "length"


def test_a_request_the_engine_fails_ends_internal_and_the_engine_carries_on(stub):
    """The simulated engine fails a request whose id holds `sim-request-error` (an error output, FinishReason
    ERROR): the call ends INTERNAL with the engine's reason, in both answer shapes."""
    for stream in (False, True):
        error = error_of(lambda: stub.Generate(generate_request(PROMPT, f"sim-request-error-{stream}", stream=stream,
                                                                max_tokens=3)))
        assert error.code() == grpc.StatusCode.INTERNAL
        assert "The engine failed this request: simulated request failure" in error.details()
    (ok,) = stub.Generate(generate_request(PROMPT, max_tokens=2))
    assert ok.complete.finish_reason == "length"


def test_a_cancelled_call_is_aborted_in_the_engine(group):
    stub = group.stub()
    wait_engine_idle(stub)
    call = stub.Generate(generate_request(PROMPT, "cancel-me", stream=True, max_tokens=5000, ignore_eos=True))
    assert next(call).chunk.token_ids and next(call).chunk.token_ids
    assert engine_running(stub) == 1
    call.cancel()
    wait_engine_idle(stub, timeout=2.0)


def test_grpcio_s_error_for_a_write_to_a_gone_client_is_not_logged():
    """grpcio logs a response written to a call whose client just went (cancelled, killed) at ERROR with a
    traceback (seen with a client killed holding 200 streams; not reproduced here on demand): the server drops
    that record, and only that one."""
    from apiserver.grpc.process import _GoneClientWrites

    class ExecuteBatchError(Exception):  # grpc._cython.cygrpc's, by name
        pass

    def record(error: type[BaseException] | None) -> logging.LogRecord:
        exc_info = (error, error(), None) if error else None
        return logging.LogRecord("grpc._cython.cygrpc", logging.ERROR, "server.pyx", 1,
                                 "%s raised in core by servicer method [%s]", ("ExecuteBatchError", "/x/Generate"),
                                 exc_info)

    gone = _GoneClientWrites()
    assert not gone.filter(record(ExecuteBatchError))
    assert gone.filter(record(RuntimeError)) and gone.filter(record(None))


def test_abort_ends_the_named_call_with_finish_reason_abort(group):
    stub = group.stub()  # one channel: the Abort reaches the API server that runs the call
    call = stub.Generate(generate_request(PROMPT, "abort-me", stream=True, max_tokens=5000, ignore_eos=True))
    assert next(call).HasField("chunk")
    stub.Abort(pb.AbortRequest(request_ids=["abort-me", "no-such-request"]))
    rest = list(call)
    assert rest[-1].complete.finish_reason == "abort" and call.code() == grpc.StatusCode.OK
    wait_engine_idle(stub, timeout=2.0)


def test_request_id_priority_and_rank_metadata(group, stub):
    responses = stub.Generate(generate_request(PROMPT, max_tokens=1), metadata=(("x-request-id", "from-metadata"),
                                                                                   ("x-priority", "-3"),
                                                                                   ("x-data-parallel-rank", "0")))
    assert list(responses)[-1].complete.finish_reason == "length"
    assert dict(responses.trailing_metadata())["x-request-id"] == "from-metadata"
    unnamed = stub.Generate(generate_request(PROMPT, max_tokens=1))
    list(unnamed)
    assert len(dict(unnamed.trailing_metadata())["x-request-id"]) == 32
    named = stub.Generate(generate_request(PROMPT, "my-own-id", max_tokens=1))
    list(named)
    assert "x-request-id" not in dict(named.trailing_metadata())
    refused = [((("x-priority", "high"),), "x-priority"), ((("x-data-parallel-rank", "1"),), "rank 1 is not served"),
               ((("x-priority", str(2**70)),), "x-priority"), ((("x-vllm-priority", "1_0"),), "x-vllm-priority")]
    for metadata, message in refused:
        error = error_of(lambda: stub.Generate(generate_request(PROMPT, max_tokens=1), metadata=metadata))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and message in error.details()
    # Nothing refused stays counted in flight (a priority past 64 bits once did, skewing the balance for good).
    assert stub.GetServerInfo(pb.GetServerInfoRequest()).active_requests == 0


def test_model_server_and_load_information(group, stub):
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.served_model_name, info.is_generation, info.vocab_size, info.max_context_length) == (
        "sim:10", True, 49152, 8192)
    assert info.architectures == ["LlamaForCausalLM"] and list(info.eos_token_ids) == [2]
    assert json.loads(info.default_sampling_params_json or "{}").keys() <= {"temperature", "top_p", "top_k", "min_p",
                                                                    "repetition_penalty"}
    server = stub.GetServerInfo(pb.GetServerInfoRequest())
    assert server.server_type == "vllm-grpc" and server.data_parallel_size == 1 and server.uptime_seconds > 0
    loads = stub.GetLoads(pb.GetLoadsRequest(include=["core"]))
    assert loads.dp_rank_count == 1 and [load.dp_rank for load in loads.loads] == [0]
    error = error_of(lambda: stub.GetLoads(pb.GetLoadsRequest(dp_rank=2)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert stub.FlushCache(common_pb2.FlushCacheRequest()).success
    assert stub.HealthCheck(pb.HealthCheckRequest()).healthy


def test_unimplemented_methods_say_so(stub):
    for call in (lambda: stub.Embed(pb.EmbedRequest()),
                 lambda: stub.StartProfile(common_pb2.StartProfileRequest()),
                 lambda: stub.StopProfile(common_pb2.StopProfileRequest()),
                 lambda: stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())):
        error = error_of(call)
        assert error.code() == grpc.StatusCode.UNIMPLEMENTED and error.details(), error


def test_standard_health_service_and_reflection(group):
    assert_health_and_reflection_serve(group)


def assert_health_and_reflection_serve(group) -> None:
    assert health_status(group.target) == health_pb2.HealthCheckResponse.SERVING
    assert health_status(group.target, SERVICE) == health_pb2.HealthCheckResponse.SERVING
    assert health_status(group.target, "no.such.Service") is None  # NOT_FOUND
    services = ProtoReflectionDescriptorDatabase(group.channel()).get_services()
    assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= set(services)


@pytest.mark.parametrize("method, shape", [
    ("/grpc.health.v1.Health/Check", "unary_unary"),
    ("/grpc.health.v1.Health/Watch", "unary_stream"),
    ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", "stream_stream"),
])
def test_grpcio_s_health_and_reflection_services_refuse_a_malformed_message_as_invalid_argument(group, method, shape):
    """As the VllmEngine service does (grpcio's own answer was UNKNOWN), and they serve on."""
    raw = b"\xff\xff\xff"
    call = getattr(group.channel(), shape)(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
    error = error_of(lambda: call(iter([raw]) if shape == "stream_stream" else raw, timeout=5))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed request message" in error.details(), error
    assert_health_and_reflection_serve(group)


def test_metrics_port_counts_calls_of_the_whole_group(group, stub):
    def counters() -> dict[str, float]:
        text = httpx.get(group.metrics_url, timeout=5).text
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line and not line.startswith("#")}

    before = counters()
    for _ in range(4):  # new channels: the calls spread over both API servers
        list(group.stub().Generate(generate_request(PROMPT, max_tokens=3)))
    error_of(lambda: stub.Generate(generate_request([], max_tokens=3)))
    after = counters()
    ok = 'supervise_grpc_requests_total{model_name="sim:10",code="OK"}'
    invalid = 'supervise_grpc_requests_total{model_name="sim:10",code="INVALID_ARGUMENT"}'
    tokens = 'supervise_generation_tokens_total{model_name="sim:10"}'
    assert after[ok] - before[ok] >= 4 and after[invalid] - before[invalid] == 1
    assert after[tokens] - before[tokens] == 12
    assert after["supervise_api_servers"] == 2
    assert httpx.get(group.metrics_url.replace("/metrics", "/other"), timeout=5).status_code == 404


def test_calls_past_their_deadline_are_counted_as_such_and_cancelled_ones_as_cancelled(group):
    """A call grpcio ends at its deadline was counted CANCELLED, as a client that left: a server too slow for
    its clients could not be told from clients that go away."""
    def counted(code: str) -> float:
        text = httpx.get(group.metrics_url, timeout=5).text
        line = f'supervise_grpc_requests_total{{model_name="sim:10",code="{code}"}} '
        return next((float(row[len(line):]) for row in text.splitlines() if row.startswith(line)), 0.0)

    before = {code: counted(code) for code in ("DEADLINE_EXCEEDED", "CANCELLED")}
    stub = group.stub()
    for _ in range(3):  # 500 tokens at 10 ms each: far past a 0.3 s deadline
        with pytest.raises(grpc.RpcError) as ended:
            list(stub.Generate(generate_request(PROMPT, max_tokens=500, ignore_eos=True), timeout=0.3))
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    call = stub.Generate(generate_request(PROMPT, stream=True, max_tokens=500, ignore_eos=True))
    next(call)
    call.cancel()
    deadline = time.monotonic() + 5
    while counted("CANCELLED") < before["CANCELLED"] + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert counted("DEADLINE_EXCEEDED") - before["DEADLINE_EXCEEDED"] == 3
    assert counted("CANCELLED") - before["CANCELLED"] == 1


def test_api_servers_load_neither_torch_nor_a_tokenizer(group):
    """What a process has mapped: torch's and the tokenizers' native libraries show there once imported (the
    simulated engine's process maps the tokenizer, so the check can see one)."""
    def mapped(pid: int) -> str:
        with open(f"/proc/{pid}/maps") as f:
            return f.read()

    engine = next(c for c in group.children() if "EngineCore_DP0" in title_of(c))
    assert "tokenizers" in mapped(engine.pid)
    for pid in group.api_server_pids():
        maps = mapped(pid)
        assert "grpc" in maps
        assert "torch" not in maps and "tokenizers" not in maps and "sentencepiece" not in maps
