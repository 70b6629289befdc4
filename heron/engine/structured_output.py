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
token in the matcher, so the step is pipelined in two halves (LLMEngine.advance): it is scheduled and its
forward pass launched as any other while the step before is still on the device; in the next iteration that
step is read back, its tokens advance the matchers, and `fill_bitmask` fills the masks on the fill thread (the
GIL released) while the next step is scheduled and prepared, all during the forward pass; its sampling is
launched last. The
read-back hands a step's tokens to their matchers at once (`accept`: xgrammar's batch accept, one C++ call per
pool thread) before the sequences take them. Steps without a grammar row are unchanged.

The matchers know the tokenizer's ids only (`mask_vocab`), not the logits' padding past them: xgrammar counts
each padded id as a special token and scans them all in every accept_token (the `structured` workload,
SmolLM2's 49,152 ids on Qwen3's 151,936 logits, paid ~35 us a token for it, 1.5 us without). The mask's words
past mask_vocab are set here: nothing allowed on a grammar's row, everything on a free row.

JSON comes in xgrammar's compact layout (no free whitespace between tokens), so that a small model cannot spend
its tokens on whitespace before the object closes.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xgrammar as xgr
from xgrammar.base import _core

from heron.sampling_params import StructuredOutputsParams

CACHE_SIZE = 128  # compiled grammars kept (a JSON schema's takes some kB to a few MB)
MIN_ACCEPT_ROWS = 64  # a pool thread's share of a step's accepts (~1.5 us each): well over a hand-off's cost
# Fewer rows than this fill on the caller's thread: the hand-off to the fill thread and back cost more than a
# small step's fill (the CI machine, `cpu-grammar-host`: 4 rows 101 us inline, 160 through the thread).
MIN_THREAD_FILL_ROWS = 32


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
    """The engine's grammar compiler (one per tokenizer), its cache, and the step's accepting and bitmask filling."""

    def __init__(
        self, tokenizer, vocab_size: int, max_num_seqs: int, device: torch.device, threads: int | None = None
    ) -> None:
        """vocab_size: the width of the model's logits (tokens past the tokenizer's are never allowed). threads:
        the host threads that accept a step's tokens and fill its masks (default 1: on the H200's 16-core host a
        step of 256 rows took 0.37 + 0.74 ms on one thread, 0.62 + 1.33 on 4 and 0.67 + 1.95 on 8; the
        threads contend more than they share, `gpu_check.sh grammar-host`)."""
        # xgrammar counts every id past the tokenizer's as a special token, and accept_token scans that list
        # (~0.3 ns an id): a model whose logits are far wider than its tokenizer (the `structured` workload:
        # SmolLM2's 49,152 ids on Qwen3's 151,936) paid ~35 us a token. So the matchers see the tokenizer's ids
        # only (rounded up to a word), and the bitmask's words past them are set here.
        self.mask_vocab = min(vocab_size, -(-(max(tokenizer.get_vocab().values()) + 1) // 32) * 32)
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.mask_vocab)
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, cache_enabled=False)  # (cached here, by key)
        self._compile_pool = ThreadPoolExecutor(1, thread_name_prefix="heron-grammar-compile")
        self._threads = threads or 1
        self._batch_matcher = xgr.BatchGrammarMatcher(self._threads)  # fills a step's rows on its own threads
        self._accept_pool = ThreadPoolExecutor(self._threads, thread_name_prefix="heron-grammar-accept")
        self._fill_pool = ThreadPoolExecutor(1, thread_name_prefix="heron-grammar-fill")
        self._stop_ids: set[int] = set()  # the tokens that can end a matcher (the only ones is_terminated needs)
        self._cache: OrderedDict[tuple[str, str], Future[xgr.CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        # One host bitmask for the step's rows, as wide as the logits, pinned on a GPU so that its upload is
        # queued, not waited for; xgrammar fills rows as wide as mask_vocab (`_filled`, the same tensor when
        # the widths agree). A single buffer is enough: a step's masks are filled after the step before is
        # read back, and so after the upload of its masks.
        self._bitmask = xgr.allocate_token_bitmask(max_num_seqs, vocab_size)
        if device.type == "cuda":
            self._bitmask = self._bitmask.pin_memory()
        self._filled = self._bitmask
        if self.mask_vocab < vocab_size:
            self._filled = xgr.allocate_token_bitmask(max_num_seqs, self.mask_vocab)
            self._bitmask[:, self._filled.shape[1] :] = 0
        self._free_tails: list[int] = []  # the rows whose words past mask_vocab are all ones (no grammar)

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

    def matcher(self, compiled: xgr.CompiledGrammar, stop_token_ids: Sequence[int]) -> xgr.GrammarMatcher:
        """A sequence's matcher: it ends on the model's EOS tokens (those the engine stops on) that the tokenizer
        has; where it has none of them (a model served with another model's tokenizer), on the tokenizer's own."""
        stops = [t for t in stop_token_ids if t < self.mask_vocab]
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None)
        self._stop_ids.update(matcher.stop_token_ids)
        return matcher

    def accept(self, matchers: list[xgr.GrammarMatcher], tokens: list[int]) -> list[bool]:
        """Advance each matcher by its token; per matcher: whether it refused the token or has ended. The rows
        go to xgrammar's batch accept, one C++ call (which releases the GIL) per pool thread, each with at
        least MIN_ACCEPT_ROWS rows: a call per row cost twice the accept itself in Python and FFI."""
        n = len(matchers)
        parts = max(1, min(self._threads, n // MIN_ACCEPT_ROWS))
        if parts == 1:
            accepted = _batch_accept(matchers, tokens)
        else:
            bounds = [n * k // parts for k in range(parts + 1)]
            spans = zip(bounds[:-1], bounds[1:])
            chunks = self._accept_pool.map(
                lambda span: _batch_accept(matchers[slice(*span)], tokens[slice(*span)]), spans
            )
            accepted = [ok for chunk in chunks for ok in chunk]
        # A matcher ends only by accepting a stop token (and refuses every token once ended).
        stops = self._stop_ids
        return [not ok or (t in stops and m.is_terminated()) for ok, t, m in zip(accepted, tokens, matchers)]

    def fill_bitmask_async(self, matchers: list[xgr.GrammarMatcher | None]) -> Future[torch.Tensor]:
        """`fill_bitmask` on the manager's fill thread, while the caller schedules and prepares the next step
        (xgrammar fills with the GIL released); done at once under MIN_THREAD_FILL_ROWS rows. The matchers must
        not change until it is done."""
        if len(matchers) >= MIN_THREAD_FILL_ROWS:
            return self._fill_pool.submit(self.fill_bitmask, matchers)
        done: Future[torch.Tensor] = Future()
        done.set_result(self.fill_bitmask(matchers))
        return done

    def fill_bitmask(self, matchers: list[xgr.GrammarMatcher | None]) -> torch.Tensor:
        """The bitmask of a step's sampled rows (None: a row without a grammar, all allowed), [len(matchers), W]
        int32 on the host, filled on xgrammar's threads. (The host's copies go through numpy: torch's threaded
        ones of a few MB took ~10 ms on a busy host.)"""
        n = len(matchers)
        free = _fill(self._batch_matcher, matchers, self._filled[:n])
        if self._filled is not self._bitmask:
            wide, width = self._bitmask.numpy(), self._filled.shape[1]
            wide[:n, :width] = self._filled.numpy()[:n]
            # The words past the tokenizer's ids: 0 (nothing allowed) but on the rows without a grammar.
            if self._free_tails:
                wide[self._free_tails, width:] = 0
            if free:
                wide[free, width:] = -1
            self._free_tails = free
        return self._bitmask[:n]


def _batch_accept(matchers: list[xgr.GrammarMatcher], tokens: list[int]) -> list[bool]:
    """xgrammar's batch accept, in one C++ call; per matcher: whether it took its token. (The public
    `BatchGrammarMatcher.batch_accept_token` reads its result back with an FFI call per row, ~3 us each: twice
    the accept itself. Here it is read only when some row refused its token, which a masked draw never does.)"""
    result = _core.BatchGrammarMatcher.batch_accept_token([m._handle for m in matchers], tokens, False)
    return [bool(ok) for ok in result] if 0 in result else [True] * len(matchers)


def _fill(batch: xgr.BatchGrammarMatcher, matchers: list[xgr.GrammarMatcher | None], mask: torch.Tensor) -> list[int]:
    """Each distinct matcher's row once (the n rows of a request's first draw share one), then the copies; a row
    without a matcher all ones. Returns the rows without a matcher."""
    first: dict[int, int] = {}
    rows, distinct, copies, free = [], [], [], []
    for i, m in enumerate(matchers):
        if m is None:
            free.append(i)
            continue
        j = first.setdefault(id(m), i)
        if j == i:
            rows.append(i)
            distinct.append(m)
        else:
            copies.append((i, j))
    batch.batch_fill_next_token_bitmask(distinct, mask, rows)
    if free or copies:
        words = mask.numpy()
        words[free] = -1
        for i, j in copies:
            words[i] = words[j]
    return free
