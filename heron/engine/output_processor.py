"""After the sampler: append each new token, detokenize it, decide whether the sequence is done, and
build the `RequestOutput` the caller sees."""

from __future__ import annotations

from heron.engine.detokenizer import IncrementalDetokenizer, LogprobTexts, StopChecker
from heron.engine.request import Request, Sequence
from heron.logprobs import RawLogprobs
from heron.outputs import CompletionOutput, RequestOutput
from heron.sampling_params import RequestOutputKind


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._detok: dict[int, IncrementalDetokenizer] = {}  # seq_id -> its detokenizer
        self._stop: dict[int, StopChecker] = {}
        self.logprobs = LogprobTexts(tokenizer)

    def append(self, seq: Sequence, token: int, logprobs: RawLogprobs | None, grammar_done: bool | None = None) -> bool:
        """Append the next token of `seq`, read back from the device; True when it finishes the sequence
        (the draws of any step launched after it are then dropped). `grammar_done`: the token already went
        to the sequence's matcher (StructuredOutputManager.accept), which then ended or refused it."""
        req = seq.request
        p = req.params
        seq.append_token(token)
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs[token][0]
        num_tokens = len(seq.token_ids)
        n_out = num_tokens - len(req.prompt_token_ids)
        stopped_by_token = n_out > p.min_tokens - 1 and token in p.all_stop_token_ids
        # structured outputs: the grammar is done (it took a stop token, or the token it was masked to)
        if grammar_done is None:
            grammar_done = seq.grammar is not None and (
                not seq.grammar.accept_token(token) or seq.grammar.is_terminated()
            )
        piece = ""
        if (
            self.tokenizer is not None
            and req.detokenizes_each_token
            and not (stopped_by_token and not p.include_stop_str_in_output)
        ):
            detok = self._detok.get(seq.seq_id)
            if detok is None:
                detok = self._detok[seq.seq_id] = IncrementalDetokenizer(
                    self.tokenizer,
                    seq.token_ids[: seq.num_prompt_tokens],
                    p.skip_special_tokens,
                    p.spaces_between_special_tokens,
                )
                self._stop[seq.seq_id] = StopChecker(p.stop, p.include_stop_str_in_output)
            piece = detok.step([token])
            seq.output_text += piece
        # Stop strings are looked for in every step's new text, but (as in vLLM) only count once
        # min_tokens are out.
        hit = self._stop[seq.seq_id].check(seq.output_text, len(piece)) if p.stop and piece else None
        if stopped_by_token:
            seq.finish_reason = "stop"
            seq.stop_reason = None if token in p.eos_token_ids and token not in p.stop_token_ids else token
        elif hit and n_out >= p.min_tokens:
            seq.output_text, seq.stop_reason = hit
            seq.finish_reason = "stop"
        elif grammar_done:
            seq.finish_reason = "stop"
        elif num_tokens >= req.length_limit:
            seq.finish_reason = "length"
        if seq.finish_reason is None:
            return False
        seq.drop_pending()
        return True

    def release(self, seq: Sequence) -> None:
        """A finished sequence flushes any text held back for an incomplete character."""
        detok = self._detok.pop(seq.seq_id, None)
        if detok is None and not seq.request.detokenizes_each_token:
            self.decode(seq)
        elif detok is not None and seq.finish_reason != "stop":
            seq.output_text += detok.flush()
        self._stop.pop(seq.seq_id, None)

    def decode(self, seq: Sequence) -> None:
        """A finished sequence's text, from all its output at once (the same decoder as streaming)."""
        if self.tokenizer is None:
            return
        p = seq.params
        ids = seq.output_token_ids
        if seq.finish_reason == "stop" and not p.include_stop_str_in_output:
            ids = ids[:-1]  # the stop token (stop strings are never deferred)
        detok = IncrementalDetokenizer(
            self.tokenizer,
            seq.token_ids[: seq.num_prompt_tokens],
            p.skip_special_tokens,
            p.spaces_between_special_tokens,
        )
        seq.output_text = detok.step(ids) if ids else ""
        if seq.finish_reason != "stop":
            seq.output_text += detok.flush()

    def visible_text(self, seq: Sequence) -> str:
        """The text a streaming client may see now: a tail that could still grow into a stop string is
        held back until it is decided."""
        if seq.is_finished or not seq.params.stop:
            return seq.output_text
        stop = self._stop.get(seq.seq_id)
        return seq.output_text[: len(seq.output_text) - stop.holdback(seq.output_text)] if stop else seq.output_text

    def make_output(self, request: Request) -> RequestOutput:
        """The request's output now: cumulative, or with RequestOutputKind.DELTA only the tokens, text and
        logprobs added since its last output (prompt fields in the first only)."""
        delta = request.params.output_kind is RequestOutputKind.DELTA
        outputs = [self._completion(self.news(s, delta)) for s in sorted(request.seqs, key=lambda s: s.index)]
        first = not delta or not request.sent_prompt
        request.sent_prompt = True
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt if first else None,
            prompt_token_ids=request.prompt_token_ids if first else [],
            # (complete by the first output)
            prompt_logprobs=self.logprobs(request.prompt_logprobs) if first else None,
            outputs=outputs,
            finished=request.is_finished,
            metrics=request.metrics,
            num_cached_tokens=request.seqs[0].num_cached_tokens,
        )

    def _completion(self, news: tuple) -> CompletionOutput:
        """`news` as the caller's CompletionOutput: its logprobs as Logprob objects (made anew at each output:
        a CUMULATIVE one converts all of them, the offline LLM's FINAL_ONLY once)."""
        index, text, token_ids, cumulative, logprobs, finish_reason, stop_reason = news
        return CompletionOutput(index, text, token_ids, cumulative, self.logprobs(logprobs), finish_reason, stop_reason)

    def news(self, s: Sequence, delta: bool = True) -> tuple:
        """A sequence's output as CompletionOutput's fields, in order (its logprobs as the engine's pairs): all
        of it, or with `delta` only the tokens, text and logprobs added since the previous call. A plain tuple,
        so that the engine process sends it as it is (engine_core.request_delta)."""
        p = s.request.params
        start, text_start = (s.num_sent_tokens, s.num_sent_chars) if delta else (0, 0)
        n = s.num_prompt_tokens
        end = len(s.token_ids) - n
        text = self.visible_text(s)
        s.num_sent_tokens, s.num_sent_chars = end, len(text)
        want_lps = p.logprobs is not None
        return (
            s.index,
            text[text_start:],
            s.token_ids[n + start : n + end],
            s.cumulative_logprob if want_lps else None,
            s.output_logprobs[start:end] if want_lps else None,
            s.finish_reason,
            s.stop_reason,
        )
