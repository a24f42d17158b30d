"""The IPC contract: every record survives the trip through its frames, and garbage is refused, not guessed at."""
import orjson
import pytest

from ipc.codec import MalformedMessage, decode, encode
from ipc.messages import (AbortRequests, EngineDead, EngineOutputs, EngineRequest, Kind, RequestOutput, UtilityCall,
                          UtilityResult)
from ipc.sampling import SamplingParams

RECORDS = [
    EngineRequest("req-1", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=[7], n=2), 3),
    AbortRequests(["req-1", "req-2"]),
    AbortRequests(["req-1"], indices=[0, 2]),
    UtilityCall(4, "stats", [1]),
    UtilityResult(4, {"num_kv_blocks": 10}, None),
    EngineOutputs([RequestOutput("req-1", [5, 6], 1, "stop", 7, 3, 0, [[-0.5, [[5, -0.5]]]]),
                   RequestOutput("req-2", [], 0, "error", error="TypeError: bad temperature")], 2, 1, 0.25),
    EngineDead("engine core 0 failed: RuntimeError: boom"),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_round_trip(record):
    frames = encode(record)
    assert len(frames) == 2
    assert decode(frames) == record


@pytest.mark.parametrize("frames", [
    [Kind.ADD],
    [b"?", orjson.dumps({})],
    [Kind.ABORT, b"not json"],
    [Kind.ADD, orjson.dumps({"request_id": "a"})],
    [Kind.ABORT, orjson.dumps({"request_ids": [], "bogus": 1})],
    [Kind.OUTPUTS, orjson.dumps([1, 2])],
])
def test_malformed_frames_raise(frames):
    with pytest.raises(MalformedMessage):
        decode(frames)


def test_outputs_not_written_whole_still_decode_through_the_dataclass():
    """An engine writes every field of each output (the fast path takes its object as it is); one written with
    fields left out gets their defaults, and one with a field of no such name is refused, not half-built."""
    short = {"outputs": [{"request_id": "r", "new_token_ids": [5]}], "num_running": 1}
    decoded = decode([Kind.OUTPUTS, orjson.dumps(short)])
    assert decoded.outputs == [RequestOutput("r", [5])] and decoded.outputs[0].finish_reason is None
    whole = orjson.loads(encode(EngineOutputs([RequestOutput("r", [5], finish_reason="stop")]))[1])
    whole["outputs"][0]["bogus"] = 1
    del whole["outputs"][0]["error"]  # as many fields as a real output, one of them unknown
    with pytest.raises(MalformedMessage):
        decode([Kind.OUTPUTS, orjson.dumps(whole)])
