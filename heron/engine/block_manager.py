"""Paged KV cache bookkeeping: which physical block holds which part of which sequence.

Pure Python over integers; the tensors live in the model runner. Blocks carry reference counts, so that
the n samples of a request (parallel_sampling.py) and requests with a common prefix share blocks; a
shared block that is only partly filled is copied before it is written (copy-on-write). With prefix
caching, a full block is named by the chained hash of its tokens; when its last user lets go it stays in
the free list, still findable, until it is evicted (least recently used first). Host blocks for swapping
are swap_space.py's. A block's hash is computed once per distinct input (`hash_memo`): the requests that open
with one system prompt look its blocks up instead of hashing them again.

When every layer of the model attends to a sliding window of W keys (Mistral), a block whose keys are all
older than the window of the next query is never read again: `allocate` lets go of it, so a long generation
holds about W / block_size + 2 blocks. The table keeps its (stale) id, so positions still index it and the
runner's copy of the table stays valid: the Triton kernels start at the window and never load it, the torch
reference loads it and masks it out. The first `num_dropped_blocks` entries of a table are such ids. With
any full-attention layer (Gemma 2/3's global layers) every block stays: those layers read them all.
"""

from __future__ import annotations

from collections import OrderedDict

from heron.engine.request import Sequence

HASH_MEMO_ENTRIES = 1 << 16  # block hashes remembered by their input (~0.4 KB each), cleared when past this


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, sliding_window: int | None = None
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window  # the window of every layer; None: some layer sees all keys
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        # Blocks nobody references, in eviction order: uncached ones first, then cached ones, least
        # recently used first. An OrderedDict gives O(1) removal when a cached block is hit again.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.hash_memo: dict[bytes, bytes] = {}  # see Sequence.update_block_hashes
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    # -- queries ---------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached(self, seq: Sequence) -> list[int]:
        """Blocks holding a prefix of `seq`. At least one token is always left to compute, since the
        model must run on the last prompt token to sample the next one; a block is never written
        once cached, so a fully cached prompt gives back its last block."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for h in self._block_hashes(seq):
            block = self.hash_to_block.get(h)
            if block is None:
                break
            hits.append(block)
        if len(hits) * self.block_size >= seq.num_tokens:
            hits.pop()
        return hits

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, as vLLM's `reset_prefix_cache` (a benchmark's arms on the same prompts
        each compute them): only while no sequence holds a block; False, with nothing changed, otherwise."""
        if len(self.free) != self.num_blocks:
            return False
        self.hash_to_block.clear()
        self.block_hash = [None] * self.num_blocks
        self.hash_memo.clear()
        return True

    # -- allocation --------------------------------------------------------------------------------

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] = ()) -> list[tuple[int, int]] | None:
        """Make room for `num_new_tokens` more tokens of `seq`, first adopting `cached` prefix blocks
        (only for a sequence that holds none). Returns the block copies (src, dst) needed before the
        write — copy-on-write of a shared, partly filled last block — or None when there is no room,
        in which case nothing changed but the release of blocks out of every layer's window.

        A block table only ever grows in place; any other change gives the sequence a new list, so the
        model runner can copy just the new entries of a table it has seen before."""
        bs, table = self.block_size, seq.block_table
        if self.sliding_window is not None:
            self._drop_out_of_window(seq)
        if not cached and seq.num_computed_tokens + num_new_tokens <= len(table) * bs:  # no new block (decode)
            at = seq.num_computed_tokens
            if at % bs == 0 or self.ref_count[table[at // bs]] <= 1:
                return []
        revived = sum(1 for b in cached if self.ref_count[b] == 0)
        computed = seq.num_computed_tokens + len(cached) * self.block_size
        needed = self.blocks_needed(computed + num_new_tokens) - len(seq.block_table) - len(cached)
        cow = computed % self.block_size != 0 and self.ref_count[seq.block_table[computed // self.block_size]] > 1
        if max(needed, 0) + cow > self.num_free_blocks - revived:
            return None
        if cached:
            assert not seq.block_table, "prefix blocks are adopted only by a sequence with none"
            for b in cached:
                self._ref(b)
            seq.block_table = list(cached)
            seq.num_computed_tokens = computed
            self.prefix_hits += computed
        copies = []
        if cow:
            i = computed // self.block_size
            src, dst = seq.block_table[i], self._pop_free()
            self.ref_count[src] -= 1
            seq.block_table = [*seq.block_table[:i], dst, *seq.block_table[i + 1 :]]  # a new list: see allocate
            copies.append((src, dst))
        for _ in range(needed):
            seq.block_table.append(self._pop_free())
        return copies

    def cache_full_blocks(self, seq: Sequence, num_computed_before: int) -> None:
        """Name the blocks that the last step filled, so later sequences can reuse them."""
        bs = self.block_size
        if not self.enable_prefix_caching or seq.num_computed_tokens // bs <= min(
            num_computed_before // bs, len(seq.block_hashes)
        ):
            return  # no block was filled (the common decode step)
        # A block computed earlier whose last token was still pending then is named now too.
        first = min(num_computed_before // bs, len(seq.block_hashes))
        hashes = self._block_hashes(seq)
        end = min(seq.num_computed_tokens // bs, len(hashes))
        for i in range(first, end):
            block, h = seq.block_table[i], hashes[i]
            if self.block_hash[block] is None and h not in self.hash_to_block:
                self.block_hash[block] = h
                self.hash_to_block[h] = block

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares all of `parent`'s blocks."""
        child.block_table = list(parent.block_table)
        child.num_dropped_blocks = parent.num_dropped_blocks
        for b in child.block_table[child.num_dropped_blocks :]:
            self.ref_count[b] += 1

    def free_seq(self, seq: Sequence) -> None:
        """Let go of the sequence's blocks; its tokens are to be computed again."""
        self.release_blocks(seq)
        seq.block_table, seq.num_dropped_blocks = [], 0
        seq.num_computed_tokens = 0

    def release_blocks(self, seq: Sequence) -> None:
        """Let go of the sequence's blocks but not of its computed count (swapping out keeps its K/V); the
        ids of blocks already out of the window stay in its table."""
        # Tail blocks go first into the free list, so they are evicted before the prefix they extend.
        for b in reversed(seq.block_table[seq.num_dropped_blocks :]):
            self._unref(b)
        seq.block_table = seq.block_table[: seq.num_dropped_blocks]

    def assign_blocks(self, seq: Sequence, count: int) -> list[int]:
        """Give `seq`, which holds no live blocks, `count` fresh ones after those out of the window (the caller
        has checked there is room); returns them."""
        fresh = [self._pop_free() for _ in range(count)]
        seq.block_table = [*seq.block_table, *fresh]
        return fresh

    def blocks_held(self, seq: Sequence) -> int:
        """The blocks `seq` references (its table less the entries out of the window)."""
        return len(seq.block_table) - seq.num_dropped_blocks

    def count_query(self, num_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens

    # -- internals ---------------------------------------------------------------------------------

    def _drop_out_of_window(self, seq: Sequence) -> None:
        """Let go of the blocks whose keys all precede the window of the next query (at position
        num_computed_tokens or later: queries only move on); at most one block per step in decode."""
        out_of_window = (seq.num_computed_tokens - self.sliding_window) // self.block_size
        while seq.num_dropped_blocks < min(out_of_window, len(seq.block_table)):
            self._unref(seq.block_table[seq.num_dropped_blocks])
            seq.num_dropped_blocks += 1

    def _block_hashes(self, seq: Sequence) -> list[bytes]:
        """seq's block hashes through the memo, which is cleared first once past HASH_MEMO_ENTRIES (wherever
        entries come from: prompts looked up, or generated blocks cached)."""
        if len(self.hash_memo) > HASH_MEMO_ENTRIES:
            self.hash_memo.clear()
        return seq.update_block_hashes(self.block_size, self.hash_memo)

    def _pop_free(self) -> int:
        block, _ = self.free.popitem(last=False)
        h = self.block_hash[block]
        if h is not None:  # evict: the block's old contents are about to be overwritten
            del self.hash_to_block[h]
            self.block_hash[block] = None
        self.ref_count[block] = 1
        return block

    def _ref(self, block: int) -> None:
        if self.ref_count[block] == 0:
            del self.free[block]
        self.ref_count[block] += 1

    def _unref(self, block: int) -> None:
        self.ref_count[block] -= 1
        assert self.ref_count[block] >= 0, f"block {block} freed twice"
        if self.ref_count[block] == 0:
            self.free[block] = None
            if self.block_hash[block] is None:
                self.free.move_to_end(block, last=False)
