"""Logprobs compared within float32 noise: a GEMM of another shape rounds its last bits differently, so the same
token's logprob differs in its sixth digit when its step held other rows (a wasted row of asynchronous scheduling,
another test's request finishing beside it). Seen: -1.3270649 against -1.3270636, -0.38011762 against -0.38011706.
Token ids, texts, finishes and errors still compare exactly."""


class Close(float):
    """A float that equals another within 1e-4 (relative, or absolute below 1)."""

    def __eq__(self, other):
        return isinstance(other, float) and abs(self - other) <= 1e-4 * max(1.0, abs(other))

    __hash__ = float.__hash__


def floats_loosened(value):
    """`value` with every float, however nested in dicts, lists and tuples, compared as Close."""
    if isinstance(value, float):
        return Close(value)
    if isinstance(value, dict):
        return {key: floats_loosened(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(floats_loosened(v) for v in value)
    return value
