"""Engine outputs to GenerateResponse messages, one sample (`index`) at a time, as vLLM's own servicer sends
them, since that is what the gateway was written against:

- streamed: a GenerateStreamChunk with the new token ids of each engine step, or of the steps that arrived
  together (`completion_tokens` is that delta's count: the gateway adds them up), their logprobs, and the
  prompt's logprobs once, in the first chunk;
  then, when the sample finishes, a GenerateComplete with its finish reason and counts;
- whole: one GenerateComplete per sample, once it finishes, with all of its tokens and logprobs.
A GenerateComplete always carries every output token of its sample (`output_ids`, as the proto says).

A sample the engine failed (finish reason "error") fails the whole call: INTERNAL with the engine's reason
(smg reads an unknown finish reason as "stop", which would pass the failure off as an answer).

The engine's logprob entries are `[sampled logprob, [[token id, logprob], ...top k]]` per token.
"""
from __future__ import annotations

from smg_grpc_proto import vllm_engine_pb2 as pb

from apiserver.engine_errors import request_error
from ipc.messages import FinishReason, RequestOutput


class Sample:
    """What one sample (`index`) of a request has produced so far."""

    __slots__ = ("index", "token_ids", "logprobs", "finish_reason", "stop_token", "sent_prompt_logprobs")

    def __init__(self, index: int):
        self.index = index
        self.token_ids: list[int] = []
        self.logprobs: list = []  # kept only for a whole (non-streamed) answer
        self.finish_reason: str | None = None
        self.stop_token: int | None = None
        self.sent_prompt_logprobs = False


class ResponseBuilder:
    def __init__(self, prompt: list[int], n: int, stream: bool, top_logprobs: int | None,
                 top_prompt_logprobs: int | None):
        self.prompt = prompt
        self.stream = stream
        self.samples = [Sample(i) for i in range(n)]
        self.unfinished = n
        self.cached_tokens = 0
        self._top = top_logprobs or 0
        self._top_prompt = top_prompt_logprobs or 0
        self._input_logprobs: pb.InputLogProbs | None = None

    @property
    def done(self) -> bool:
        return self.unfinished == 0

    def add(self, outputs: list[RequestOutput]) -> list[pb.GenerateResponse]:
        """The responses a batch of engine outputs makes: per sample, one chunk for all of its new tokens (a
        server that fell behind the engine sends fewer, larger messages), and its complete if it finished."""
        if len(outputs) == 1:
            return self._add_sample(outputs[0].index, outputs)
        by_sample: dict[int, list[RequestOutput]] = {}
        for out in outputs:
            by_sample.setdefault(out.index, []).append(out)
        responses = []
        for index, outs in by_sample.items():
            responses += self._add_sample(index, outs)
        return responses

    def _add_sample(self, index: int, outputs: list[RequestOutput]) -> list[pb.GenerateResponse]:
        sample = self.samples[index]
        if sample.finish_reason is not None:
            return []
        new, logprobs, finish = [], [], None
        for out in outputs:
            if out.num_cached_tokens and not sample.token_ids and not new:
                self.cached_tokens = max(self.cached_tokens, out.num_cached_tokens)
            if out.prompt_logprobs is not None:  # once per request, with sample 0's first output
                self._input_logprobs = self._prompt_logprobs(out.prompt_logprobs)
            new += out.new_token_ids
            if out.logprobs:
                logprobs += out.logprobs
            if out.finish_reason is not None:
                if out.finish_reason == FinishReason.ERROR:  # the whole call fails, as an HTTP request does
                    raise request_error(out, "sampling_params")
                finish = out
                break
        sample.token_ids += new
        responses = []
        if self.stream:
            first = not sample.sent_prompt_logprobs and self._input_logprobs is not None
            if new or first:
                responses.append(pb.GenerateResponse(chunk=pb.GenerateStreamChunk(
                    token_ids=new, prompt_tokens=len(self.prompt), completion_tokens=len(new),
                    cached_tokens=self.cached_tokens, index=index,
                    output_logprobs=self._output_logprobs(logprobs, new) if logprobs else None,
                    input_logprobs=self._input_logprobs if first else None,
                )))
                sample.sent_prompt_logprobs |= first
        elif logprobs:
            sample.logprobs += logprobs
        if finish is not None:
            responses.append(self.finish(sample, finish.finish_reason, finish.stop_reason))
        return responses

    def finish(self, sample: Sample, reason: str, stop_token: int | None = None) -> pb.GenerateResponse:
        sample.finish_reason, sample.stop_token = reason, stop_token
        self.unfinished -= 1
        complete = pb.GenerateComplete(
            output_ids=sample.token_ids, finish_reason=reason, prompt_tokens=len(self.prompt),
            completion_tokens=len(sample.token_ids), cached_tokens=self.cached_tokens, index=sample.index,
        )
        if not self.stream:  # a stream sent these with its chunks
            if sample.logprobs:
                complete.output_logprobs.CopyFrom(self._output_logprobs(sample.logprobs, sample.token_ids))
            if self._input_logprobs is not None:
                complete.input_logprobs.CopyFrom(self._input_logprobs)
        if stop_token is not None:
            complete.matched_token_id = stop_token
        return pb.GenerateResponse(complete=complete)

    def finish_unfinished(self, reason: str) -> list[pb.GenerateResponse]:
        """Every sample still running ends now with `reason` (an Abort)."""
        return [self.finish(s, reason) for s in self.samples if s.finish_reason is None]

    def _output_logprobs(self, entries: list, token_ids: list[int]) -> pb.OutputLogProbs:
        message = pb.OutputLogProbs(token_ids=token_ids[:len(entries)], token_logprobs=[e[0] for e in entries])
        if self._top:
            message.top_logprobs.extend(_top(top[:self._top]) for _, top in entries)
        return message

    def _prompt_logprobs(self, entries: list) -> pb.InputLogProbs:
        """The first prompt token has no logprob (nothing before it predicts it): an unset value."""
        message = pb.InputLogProbs(token_ids=self.prompt)
        message.token_logprobs.append(pb.InputTokenLogProb())
        message.token_logprobs.extend(pb.InputTokenLogProb(value=e[0]) for e in entries)
        if self._top_prompt:
            message.top_logprobs.append(pb.TopLogProbs())
            message.top_logprobs.extend(_top(top[:self._top_prompt]) for _, top in entries)
        return message


def _top(pairs: list) -> pb.TopLogProbs:
    return pb.TopLogProbs(token_ids=[p[0] for p in pairs], values=[p[1] for p in pairs])
