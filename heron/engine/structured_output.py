"""Structured outputs: constrained decoding with xgrammar, as in vLLM.

A request's constraint (`StructuredOutputsParams`: a JSON schema, any JSON object, a regex, a choice, an EBNF
grammar or a structural tag) becomes an xgrammar `Grammar` when the request is added (`build_grammar`: an
invalid one is a ValueError naming the field, before the engine holds anything of the request), then a
`CompiledGrammar` for this tokenizer in a thread pool, off the step; compiled grammars are kept in an LRU cache
keyed by (kind, spec), which also shares one compile between requests that ask for the same constraint while
it runs. A request waits outside the scheduler until its grammar is compiled (LLMEngine), so it holds no seat
or block meanwhile and blocks no other request.

Each sequence of a constrained request holds a `GrammarMatcher` (`Sequence.grammar`), advanced with every token
read back (OutputProcessor.append); a matcher that terminates finishes the sequence ("stop"). The sequences of
an n > 1 request fork their matcher with their blocks. Tokens reach the matcher only once they are on the host
and final, so nothing ever has to be rolled back: a sequence preempted by recompute keeps its tokens (and its
matcher with them), and the pending draws dropped when a sequence finishes were never accepted.

Each step, the rows that draw under a grammar get a token bitmask ([rows, ceil(V / 32)] int32, bit v of a row:
token v allowed); the sampler applies it to the logits (executor/sampler.py). A mask needs its row's previous
token in the matcher, so the step is pipelined in two halves (LLMEngine._grammar_masks): it is scheduled and its
forward pass launched as any other while the step before is still on the device; then that step is read back,
its tokens advance the matchers, and `fill_bitmask` fills the masks on xgrammar's threads (the GIL released)
while the forward pass runs; the sampling is launched last. The read-back hands a step's tokens to their
matchers on a thread pool (`accept`) before the sequences take them. Steps without a grammar row are unchanged.

JSON comes in xgrammar's compact layout (no free whitespace between tokens), so that a small model cannot spend
its tokens on whitespace before the object closes.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xgrammar as xgr

from heron.sampling_params import StructuredOutputsParams

CACHE_SIZE = 128  # compiled grammars kept (a JSON schema's takes some kB to a few MB)


def constraint(params: StructuredOutputsParams) -> tuple[str, object]:
    """The one constraint a StructuredOutputsParams holds: (its field name, its value)."""
    for kind in ("json", "regex", "choice", "grammar", "json_object", "structural_tag"):
        value = getattr(params, kind)
        if value not in (None, False):
            return kind, value
    raise ValueError("structured_outputs holds no constraint.")


def cache_key(params: StructuredOutputsParams) -> tuple[str, str]:
    kind, value = constraint(params)
    return kind, value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def build_grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    """The constraint as an xgrammar Grammar (tokenizer-independent, fast). Raises ValueError naming the
    field (`structured_outputs.json`, ...) when the schema, regex or grammar is invalid."""
    kind, value = constraint(params)
    try:
        if kind == "json":
            schema = json.loads(value) if isinstance(value, str) else value
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema is an object")
            return xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema({"type": "object"}, any_whitespace=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(value)
        if kind == "choice":
            if not value or not all(isinstance(c, str) for c in value):
                raise ValueError("a choice is a non-empty list of strings")
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in value))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(value)
        return xgr.Grammar.from_structural_tag(value)
    except (RuntimeError, ValueError, TypeError, json.JSONDecodeError) as e:  # xgrammar raises RuntimeError
        raise ValueError(f"structured_outputs.{kind} is invalid: {_first_line(e)}") from e


def _first_line(e: Exception) -> str:
    """The error's message without xgrammar's "[time] file.cc:line: " prefix."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)


class StructuredOutputManager:
    """The engine's grammar compiler (one per tokenizer), its cache, and the step's bitmask filling."""

    def __init__(self, tokenizer, vocab_size: int, max_num_seqs: int, device: torch.device) -> None:
        """vocab_size: the width of the model's logits (tokens past the tokenizer's are never allowed)."""
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, cache_enabled=False)  # (cached here, by key)
        self._compile_pool = ThreadPoolExecutor(1, thread_name_prefix="heron-grammar-compile")
        self._batch_matcher = xgr.BatchGrammarMatcher()  # fills a step's rows on xgrammar's own threads
        self._threads = max(1, min(8, (os.cpu_count() or 2) // 2))  # (as many as BatchGrammarMatcher's, at most 8)
        self._accept_pool = ThreadPoolExecutor(self._threads, thread_name_prefix="heron-grammar-accept")
        self._cache: OrderedDict[tuple[str, str], Future[xgr.CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        # One host bitmask for the step's rows, pinned on a GPU so that its upload is queued, not waited for. A
        # single buffer is enough: a step's masks are filled after the step before is read back, and so after
        # the upload of its masks.
        self._bitmask = xgr.allocate_token_bitmask(max_num_seqs, vocab_size)
        if device.type == "cuda":
            self._bitmask = self._bitmask.pin_memory()

    def compile(self, params: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of `params`, from the cache or compiled in the pool. Raises ValueError (naming
        the field) at once for an invalid constraint."""
        key = cache_key(params)
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self._cache.move_to_end(key)
                return future
        grammar = build_grammar(params)
        future = self._compile_pool.submit(self.compiler.compile_grammar, grammar)
        with self._lock:
            self._cache[key] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return future

    @staticmethod
    def matcher(compiled: xgr.CompiledGrammar, stop_token_ids: Sequence[int]) -> xgr.GrammarMatcher:
        """A sequence's matcher: it ends on the model's EOS tokens (those the engine stops on)."""
        return xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids) or None)

    def accept(self, matchers: list[xgr.GrammarMatcher], tokens: list[int]) -> list[bool]:
        """Advance each matcher by its token, on the pool's threads (xgrammar releases the GIL; a JSON schema's
        token takes tens of microseconds); per matcher: whether it refused the token or has ended."""
        chunks = [range(i, len(matchers), self._threads) for i in range(min(self._threads, len(matchers)))]
        done = [False] * len(matchers)

        def run(rows: range) -> None:
            for i in rows:
                done[i] = not matchers[i].accept_token(tokens[i]) or matchers[i].is_terminated()

        if len(chunks) > 1:
            list(self._accept_pool.map(run, chunks))
        elif chunks:
            run(chunks[0])
        return done

    def fill_bitmask(self, matchers: list[xgr.GrammarMatcher | None]) -> torch.Tensor:
        """The bitmask of a step's sampled rows (None: a row without a grammar, all allowed), [len(matchers), W]
        int32 on the host, filled on xgrammar's threads."""
        return _fill(self._batch_matcher, matchers, self._bitmask[: len(matchers)])


def _fill(
    batch: xgr.BatchGrammarMatcher, matchers: list[xgr.GrammarMatcher | None], mask: torch.Tensor
) -> torch.Tensor:
    """Each distinct matcher's row once (the n rows of a request's first draw share one), then the copies."""
    mask.fill_(-1)
    first: dict[int, int] = {}
    rows, distinct, copies = [], [], []
    for i, m in enumerate(matchers):
        if m is None:
            continue
        j = first.setdefault(id(m), i)
        if j == i:
            rows.append(i)
            distinct.append(m)
        else:
            copies.append((i, j))
    batch.batch_fill_next_token_bitmask(distinct, mask, rows)
    for i, j in copies:
        mask[i] = mask[j]
    return mask
