"""The API process's side of a request's outputs: the engine process sends deltas (messages.RequestDelta),
and the caller gets the RequestOutputs it asked for (SamplingParams.output_kind), each time it asks:
everything new since it last asked, merged into one delta (DELTA, what the server streams); the whole output
so far (CUMULATIVE, the default); or the final output only (FINAL_ONLY). The deltas' logprobs become Logprob
objects here, once each."""

from __future__ import annotations

from heron.engine.detokenizer import LogprobTexts
from heron.engine.messages import CompletionDelta, RequestDelta
from heron.logprobs import SampleLogprobs
from heron.outputs import CompletionOutput, RequestMetrics, RequestOutput
from heron.sampling_params import RequestOutputKind


class OutputAssembler:
    """Fed on the event loop's thread (`add`), read by the request's caller (`ready`, `take`)."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        kind: RequestOutputKind,
        logprobs: LogprobTexts | None = None,
    ):
        """`logprobs`: the API process's (AsyncLLM's, shared by its requests); None: no tokenizer there."""
        self.request_id, self.prompt, self.prompt_token_ids, self.kind = request_id, prompt, prompt_token_ids, kind
        self.logprobs = logprobs or LogprobTexts(None)
        self.prompt_logprobs: list | None = None
        self.num_cached_tokens = 0
        self.embedding: list[float] | None = None  # a pooling request's, with its final delta
        self.finished = False
        self.times: tuple = ()
        self.pending: list[RequestDelta] = []  # DELTA: received, not yet taken
        self.completions: dict[int, CompletionOutput] = {}  # CUMULATIVE, FINAL_ONLY: all of each sample so far
        self.announced: set[int] = set()  # DELTA: samples whose finish the caller has seen
        self.taken_first = False
        self.fresh = False

    def add(self, delta: RequestDelta) -> None:
        if delta.first:
            self.prompt_logprobs, self.num_cached_tokens = self.logprobs(delta.prompt_logprobs), delta.num_cached_tokens
        self.finished, self.times = delta.finished, delta.times
        if delta.finished:
            self.embedding = delta.embedding
        self.fresh = True
        if self.kind is RequestOutputKind.DELTA:
            self.pending.append(delta)
            return
        for d in map(CompletionDelta, delta.completions):
            c = self.completions.get(d.index)
            if c is None:
                c = self.completions[d.index] = CompletionOutput(d.index, "", [], None, None)
            _extend(c, d, self.logprobs(d.logprobs))
            c.cumulative_logprob, c.finish_reason, c.stop_reason = d.cumulative_logprob, d.finish_reason, d.stop_reason

    def ready(self) -> bool:
        """Whether `take` has something for the caller."""
        return self.finished if self.kind is RequestOutputKind.FINAL_ONLY else self.fresh

    def take(self) -> RequestOutput:
        """The caller's next output: a new object each time (a reader holding one across an await must not see
        it change)."""
        self.fresh = False
        first = not self.taken_first
        self.taken_first = True
        if self.kind is RequestOutputKind.DELTA:
            outputs = self._merged()
        else:
            outputs = [_copy(c) for _, c in sorted(self.completions.items())]
            first = True  # cumulative outputs always carry the prompt
        return RequestOutput(
            self.request_id,
            self.prompt if first else None,
            self.prompt_token_ids if first else [],
            self.prompt_logprobs if first else None,
            outputs,
            self.finished,
            RequestMetrics(*self.times),
            self.num_cached_tokens,
        )

    def _merged(self) -> list[CompletionOutput]:
        """The pending deltas as one: per sample, its new text, tokens and logprobs, and its latest state; a
        sample with nothing new is left out (its finish is said once)."""
        merged: dict[int, CompletionOutput] = {}
        for delta in self.pending:
            for d in map(CompletionDelta, delta.completions):
                c = merged.get(d.index)
                logprobs = self.logprobs(d.logprobs)
                if c is None:  # the delta's lists are this process's own (unpickled): taken as they are
                    merged[d.index] = CompletionOutput(
                        d.index, d.text, d.token_ids, d.cumulative_logprob, logprobs, d.finish_reason, d.stop_reason
                    )
                    continue
                _extend(c, d, logprobs)
                c.cumulative_logprob, c.finish_reason, c.stop_reason = (
                    d.cumulative_logprob,
                    d.finish_reason,
                    d.stop_reason,
                )
        self.pending = []
        outputs = []
        for index, c in sorted(merged.items()):
            if c.token_ids or c.text or (c.finish_reason is not None and index not in self.announced):
                outputs.append(c)
                if c.finish_reason is not None:
                    self.announced.add(index)
        return outputs


def _extend(c: CompletionOutput, d: CompletionDelta, logprobs: SampleLogprobs | None) -> None:
    """Add a delta to `c`: `logprobs` are its logprobs as Logprob objects."""
    c.text += d.text
    c.token_ids += d.token_ids
    if logprobs is not None:
        if c.logprobs is None:
            c.logprobs = []
        c.logprobs += logprobs


def _copy(c: CompletionOutput) -> CompletionOutput:
    logprobs = None if c.logprobs is None else list(c.logprobs)
    return CompletionOutput(
        c.index, c.text, list(c.token_ids), c.cumulative_logprob, logprobs, c.finish_reason, c.stop_reason
    )
