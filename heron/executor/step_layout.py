"""A scheduled batch laid out for the device, in numpy over the plain batch (heron/batch.py): where its tokens
sit, its input ids, its sampling rows and the rows that score prompt tokens. The model runner writes these
into the step's input buffers (input_buffers.py)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from heron.batch import SamplingSpec, ScheduledBatch


class Tokens(NamedTuple):
    """Where a step's tokens sit."""

    total: int
    decode: bool  # one token per sequence
    max_query_len: int
    seq_lens: np.ndarray  # per sequence: its length after this step
    qsl: np.ndarray  # query_start_loc: per sequence, its first token's index; then the total
    seq_of_token: np.ndarray  # per token: its sequence
    positions: np.ndarray  # per token: its position in its sequence


def token_layout(num_tokens: list[int], starts: np.ndarray, arange: np.ndarray) -> Tokens:
    """`num_tokens` new tokens per sequence after its `starts` computed ones (`arange`: 0, 1, 2, ... long
    enough). A decode step (the common one) needs no cumulative sums or repeats."""
    num_seqs, total = len(num_tokens), sum(num_tokens)
    if total == num_seqs:
        return Tokens(total, True, 1, starts + 1, arange[: num_seqs + 1], arange[:num_seqs], starts)
    counts = np.array(num_tokens, dtype=np.int64)
    qsl = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(counts, out=qsl[1:])
    seq_of_token = np.repeat(arange[:num_seqs], counts)
    positions = np.arange(total) - qsl[seq_of_token] + starts[seq_of_token]
    return Tokens(total, False, max(num_tokens), starts + counts, qsl, seq_of_token, positions)


def host_input_ids(token_ids: list[list[int]], starts: list[int], t: Tokens) -> list[int] | np.ndarray:
    """The step's input token ids, 0 where the token is not on the host yet (the previous step's sample,
    at most a sequence's last input: copied in on the device)."""
    if t.decode:
        return [tok[x] if x < len(tok) else 0 for tok, x in zip(token_ids, starts)]
    ends = t.seq_lens.tolist()
    return np.concatenate([tok[x:y] if y <= len(tok) else [*tok[x:], 0] for tok, x, y in zip(token_ids, starts, ends)])


class SamplingRows(NamedTuple):
    """A step's sampling rows: num_samples of them per sequence, in the batch's order."""

    one_each: bool  # every sequence draws one token (rows are sequences)
    seq_of_row: list[int] | range  # per row: its sequence's index in the batch
    seq_ids: list[int | None]  # per row: its sequence's id (None: a forking draw's rows past its first)
    specs: list[SamplingSpec]  # per row: its sampling constants
    positions: np.ndarray  # per row: the output position of the token it draws
    token_index: np.ndarray  # per row: the step's token whose logits it samples


def sampling_rows(batch: ScheduledBatch, seq_lens: np.ndarray, qsl: np.ndarray) -> SamplingRows:
    """The sampling rows. A draw that forks gives one row per sample, with the sample indices from the
    sequence's own on."""
    width, specs, num_seqs = batch.num_samples, batch.sampling, len(batch)
    num_prompt = np.fromiter((s.num_prompt_tokens for s in specs), np.int64, num_seqs)
    out_pos = seq_lens - num_prompt
    if width.count(1) == num_seqs:
        return SamplingRows(True, range(num_seqs), batch.seq_ids, specs, out_pos, qsl[1:] - 1)
    rows = [(i, j) for i, w in enumerate(width) for j in range(w)]
    seq_of_row = [i for i, _ in rows]
    seq_ids = [batch.seq_ids[i] if j == 0 else None for i, j in rows]
    row_specs = [specs[i].for_row(j) for i, j in rows]
    return SamplingRows(False, seq_of_row, seq_ids, row_specs, out_pos[seq_of_row], np.repeat(qsl[1:] - 1, width))


class PromptLogprobRows(NamedTuple):
    indices: list[int]  # the step's tokens whose logits score a prompt token
    targets: list[int]  # the prompt tokens they score
    k: int  # the largest number of top logprobs asked (-1: none)
    rows: list[tuple[int, int, int]]  # per sequence that asked: (its index, its count of indices, its k)


def prompt_logprob_rows(
    batch: ScheduledBatch, starts: np.ndarray, seq_lens: np.ndarray, qsl: np.ndarray
) -> PromptLogprobRows:
    """For the sequences that score their prompt this step: which logits rows, of which prompt tokens."""
    indices, targets, k, rows = [], [], -1, []
    for i in batch.prompt_logprobs:
        spec = batch.sampling[i]
        # logits at prompt position p score prompt token p + 1
        start, last = int(starts[i]), min(int(seq_lens[i]), spec.num_prompt_tokens - 1)
        count = max(last - start, 0)
        indices += range(qsl[i], qsl[i] + count)
        targets += batch.token_ids[i][start + 1 : last + 1]
        k = max(k, spec.params.prompt_logprobs)
        rows.append((i, count, spec.params.prompt_logprobs))
    return PromptLogprobRows(indices, targets, k, rows)
