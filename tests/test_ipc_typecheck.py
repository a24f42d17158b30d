"""ipc.typecheck: the field-by-field check of every record from the network, case by case (what JSON can carry
that a field must refuse), and through ipc.codec for the list a peer can make longest, a prompt's token ids."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import orjson
import pytest

from ipc.codec import MalformedMessage, decode
from ipc.messages import Kind
from ipc.typecheck import checked, matches

TOP, BOTTOM = 2**64 - 1, -(2**63)


@pytest.mark.parametrize("hint,good,bad", [
    (int, [0, -5, TOP, BOTTOM], [True, False, 1.0, "1", None, TOP + 1, BOTTOM - 1, [1]]),
    (float, [0, 1.5, -2, 1e300], [True, "1.0", None, [1.0]]),
    (bool, [True, False], [0, 1, "true", None]),
    (str, ["", "a"], [1, None, b"a", ["a"]]),
    (int | None, [None, 3], [True, "3", 2.5]),
    (list[int], [[], [1, 2, 3], [TOP, BOTTOM], list(range(5000))],
     [[True], [1, True], [1.0], ["a"], [TOP + 1], [BOTTOM - 1], [None], (1, 2), "12", None, [[1]]]),
    (list[str], [[], ["a", "b"]], [[1], ["a", None], "ab"]),
    (list[list[int]], [[], [[1], []]], [[1], [[True]], [["a"]]]),
    (list[int] | None, [None, [1]], [[False], 1]),
    (dict, [{}, {"a": 1}], [[], None]),
    (object, [None, 1, "x", [1]], []),
])
def test_each_hint_takes_what_it_should_and_nothing_else(hint, good, bad):
    for value in good:
        assert matches(value, hint), (hint, value)
    for value in bad:
        assert not matches(value, hint), (hint, value)


@dataclass
class Record:
    ids: list[int]
    name: str
    weight: float = 1.0
    tags: list[str] = field(default_factory=list)


def test_checked_builds_only_whole_well_typed_records():
    assert checked(Record, {"ids": [1, 2], "name": "x"}) == Record([1, 2], "x")
    assert checked(Record, {"ids": [], "name": "x", "weight": 2, "tags": ["a"]}) == Record([], "x", 2, ["a"])
    with pytest.raises(KeyError):
        checked(Record, {"ids": [1]})  # a required field missing
    with pytest.raises(TypeError, match="unknown fields"):
        checked(Record, {"ids": [1], "name": "x", "extra": 1})
    with pytest.raises(TypeError, match="ids"):
        checked(Record, {"ids": [1, True], "name": "x"})
    with pytest.raises(TypeError):
        checked(Record, ["ids", "name"])


@pytest.mark.parametrize("ids", [[1, True], [1, 2.0], [1, "2"], [1, 2**64], [1, -(2**63) - 1], [1, None], [[1]]])
def test_a_prompt_with_a_token_id_of_the_wrong_kind_is_refused_at_decoding(ids):
    # json, not orjson: orjson refuses to write ints beyond 64 bits, and a hostile peer need not use it.
    body = json.dumps({"request_id": "x", "prompt_token_ids": list(range(3000)) + ids, "sampling": {}}).encode()
    with pytest.raises(MalformedMessage):
        decode([Kind.ADD, body])
    assert decode([Kind.ADD, orjson.dumps({"request_id": "x", "prompt_token_ids": list(range(3000)),
                                           "sampling": {}})]).prompt_token_ids == list(range(3000))
