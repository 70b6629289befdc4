"""Which captured CUDA graph runs a step. A graph is keyed by the padded (num_tokens, num_seqs) of the arrays
it reads (input_buffers.py: their places depend only on those two counts) and by the longest query chunk its
attention grids cover, so a step runs in a graph by being padded to its key.

- Decode graphs (B, B, 1): B one-token sequences, B in 1, 2, 4, 8, 16, 24, ... up to the largest decode step.
- Small-step graphs (T, S, T): any step that is not a decode, of at most T tokens and S sequences (prefill
  chunks, and chunks beside a few decode rows). T in 16, 32, ..., 512 and the step cap under 512; S = min(T - 1,
  8, max_num_seqs): a step with a chunk of two tokens or more has at most T - 1 sequences, so S < T and the
  keys never meet a decode graph's. The cap on S bounds the attention programs a small step wastes (both
  kernels' grids have one row of programs per sequence slot; empty slots exit at once).
- Mixed graphs (T, N, Q), N = min(T - 1, max_num_seqs): decode rows beside new prompts, the steady state of a
  job of many short requests (each step admits a few prompts in the places of finished sequences). N holds any
  step of T tokens, and no more slots than it can have: at 1,024 seats a step of 300 tokens pads to a graph
  of 319 sequence slots, not 1,024. Such a step run eagerly is bound by its ~10 kernel launches a layer from
  Python (~30 ms for Qwen3-0.6B on the H200, against ~3 ms replayed). T in steps of 64 tokens to 512, of 128
  to 1024, of 256 to 2048 (padding costs at most a quarter more matmul rows); Q, the prefill kernel's query
  tiles per sequence, either MIXED_SHORT_QUERY (short prompts: one tile row a sequence) or T (any chunk).
Anything larger runs eagerly (each graph costs capture time at start-up and memory in the graphs' pool).
"""

from __future__ import annotations

GraphKey = tuple[int, int, int]  # (num_tokens, num_seqs, max_query_len) of a captured step's padded arrays

PREFILL_TOKENS = (16, 32, 64, 128, 256, 512)
PREFILL_MAX_SEQS = 8
MIXED_TOKENS = (*range(64, 513, 64), *range(640, 1025, 128), *range(1280, 2049, 256))
MIXED_SHORT_QUERY = 64


def is_decode(key: GraphKey) -> bool:
    return key[0] == key[1]


class GraphKeys:
    """The captured graphs' keys, and the one that runs a step (None: eager)."""

    def __init__(self, decode_sizes: list[int], prefill: list[GraphKey], mixed: list[GraphKey] | None = None) -> None:
        self.decode_sizes = sorted(decode_sizes)
        self.prefill = sorted(prefill)
        self.mixed = sorted(mixed or [])
        largest = max(self.decode_sizes, default=0)
        self._decode_for = {n: next(s for s in self.decode_sizes if s >= n) for n in range(1, largest + 1)}

    @classmethod
    def plan(cls, max_num_seqs: int, max_num_batched_tokens: int, prefill: bool) -> GraphKeys:
        """The keys worth capturing for these limits (a decode step has at most max_num_batched_tokens
        sequences); `prefill`: the attention backend can replay any mix of rows (else decode graphs only)."""
        top = min(max_num_seqs, max_num_batched_tokens)
        decode = {s for s in (1, 2, 4, *range(8, top + 1, 8)) if s <= top} | {top}
        if not prefill:
            return cls(sorted(decode), [])
        small = []
        cap = min(max_num_batched_tokens, PREFILL_TOKENS[-1])
        for tokens in sorted({t for t in PREFILL_TOKENS if t < cap} | {cap}):
            seqs = min(tokens - 1, PREFILL_MAX_SEQS, max_num_seqs)
            if seqs >= 1:
                small.append((tokens, seqs, tokens))
        mixed = set()
        cap = min(max_num_batched_tokens, MIXED_TOKENS[-1])
        for tokens in {t for t in MIXED_TOKENS if t < cap} | {cap}:
            seqs = min(tokens - 1, max_num_seqs)
            if seqs > PREFILL_MAX_SEQS:
                mixed.update((tokens, seqs, q) for q in (min(MIXED_SHORT_QUERY, tokens), tokens))
        return cls(sorted(decode), small, sorted(mixed))

    def all(self) -> list[GraphKey]:
        """Every key, largest first (the capture order: later graphs fit in the pool the first ones made)."""
        return sorted([(s, s, 1) for s in self.decode_sizes] + self.prefill + self.mixed, reverse=True)

    def for_step(self, num_tokens: int, num_seqs: int, decode: bool, max_query_len: int) -> GraphKey | None:
        """The smallest graph that holds the step, if any; `decode`: one token per sequence. A step of a few
        sequences takes a small-step graph even where a mixed one has fewer tokens: a mixed graph's attention
        grids span every sequence slot."""
        if decode:
            size = self._decode_for.get(num_seqs)
            return None if size is None else (size, size, 1)
        return next(
            (
                k
                for k in (*self.prefill, *self.mixed)
                if k[0] >= num_tokens and k[1] >= num_seqs and k[2] >= max_query_len
            ),
            None,
        )
