"""Beam search as transformers' `generate(num_beams=k, do_sample=False)` decides it, on the engine's forks.

Every live beam is one Sequence. Its draw is greedy and carries its 2k most likely tokens' logprobs (k per
EOS token more), so that one step gives, per request, all the candidates transformers ranks: each beam's
summed logprob plus a next token's. `BeamSearch.step` takes the best 2k of them: of those among the first
k that end (EOS, or max_tokens reached), a finished hypothesis is kept (scored by the sum over the
generated length ** length_penalty, the best k kept); the first k that do not end are the next beams.
`advance` then makes the sequences match: a beam picked once keeps its sequence, one picked again
forks (the block manager shares all its blocks, copying only the partly filled last one before it is
written), one not picked is retired. The prompt's blocks are thus never copied.

The engine reads every step back at once while a beam request runs (the next step's tokens are chosen
here); this bookkeeping is per beam request and step, and requests without beam search never reach it.
A beam preempted by lack of blocks misses a step: the step goes on with the beams that reported, and the
missing one is retired.
"""

from __future__ import annotations

from heron.engine.request import Request, Sequence, SequenceStatus
from heron.engine.scheduler import Scheduler
from heron.logprobs import RawLogprobs
from heron.sampling_params import BeamSearchParams

# A candidate continuation: (summed logprob, its beam, the token, the token's (logprob, rank))
Candidate = tuple[float, Sequence, int, tuple[float, int]]


def num_logprobs(params: BeamSearchParams, num_eos: int) -> int:
    """How many candidates transformers keeps per step, each beam's draw must carry as many logprobs."""
    return max(2, 1 + (0 if params.ignore_eos else num_eos)) * params.beam_width


class BeamSearch:
    """One request's beam search: its finished hypotheses and whether better ones may still come."""

    def __init__(
        self, params: BeamSearchParams, eos_token_ids: tuple[int, ...], num_returned: int, max_tokens: int
    ) -> None:
        self.params = params
        self.max_tokens = max_tokens  # the request's (SamplingParams.max_tokens as the engine set it)
        self.eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self.num_returned = num_returned
        self.finished: list[tuple[float, Sequence]] = []  # (length-penalised score, hypothesis), best first
        self.improvable = True  # transformers' is_early_stop_heuristic_unsatisfied
        self.done = False

    def step(self, reports: list[tuple[Sequence, RawLogprobs]]) -> list[Candidate]:
        """The beams that reported this step, each with its draw's logprobs (its new token is still pending):
        keeps the hypotheses that finish, and returns the next beams (none when the search is over)."""
        k, p = self.params.beam_width, self.params
        gen_len = reports[0][0].num_output_tokens  # generated tokens, the pending one included
        candidates = sorted(
            ((seq.cumulative_logprob + lp[0], seq, tok, lp) for seq, lps in reports for tok, lp in lps.items()),
            key=lambda c: -c[0],
        )[: num_logprobs(p, len(self.eos))]
        at_limit = gen_len >= self.max_tokens
        ends = [at_limit or c[2] in self.eos for c in candidates]
        can_add = self.improvable and not (p.early_stopping is True and len(self.finished) == k)
        for c, end in zip(candidates[:k], ends[:k]):
            if end and can_add:
                self.finished.append((c[0] / gen_len**p.length_penalty, self._hypothesis(c)))
        self.finished.sort(key=lambda f: -f[0])
        del self.finished[k:]
        beams = [c for c, end in zip(candidates, ends) if not end][:k]
        if beams:
            length = self.max_tokens if p.early_stopping == "never" and p.length_penalty > 0 else gen_len
            best = beams[0][0] / length**p.length_penalty
            self.improvable = self.improvable and (len(self.finished) < k or best > self.finished[-1][0])
        self.done = not beams or not self.improvable or (p.early_stopping is True and len(self.finished) == k)
        return [] if self.done else beams

    def _hypothesis(self, c: Candidate) -> Sequence:
        """A finished beam: its tokens and logprobs only (it holds no blocks)."""
        score, parent, token, lp = c
        seq = Sequence(parent.request, 0, [*parent.token_ids, token])
        seq.cumulative_logprob = score
        seq.output_logprobs = [*parent.output_logprobs, {token: lp}]
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "stop" if token in self.eos else "length"
        return seq

    def results(self) -> list[Sequence]:
        """The best `num_returned` hypotheses, best first, indexed as the request's samples."""
        out = [seq for _, seq in self.finished[: self.num_returned]]
        for i, seq in enumerate(out):
            seq.index = i
        return out


def advance(request: Request, reports: list[tuple[Sequence, RawLogprobs]], scheduler: Scheduler) -> None:
    """Apply a step of `request`'s beam search to its sequences: the next beams get their tokens (forking
    a beam picked twice), the others are retired; once it is over, its sequences are the results."""
    for seq, _ in reports:
        seq.num_samples = 1  # its first draw is done: from now on each beam draws once
    beams = request.beam.step(reports)
    picked: set[int] = set()
    live = []
    for score, parent, token, lp in beams:  # fork before any token is appended: a child shares its parent's past
        seq = parent if parent.seq_id not in picked else scheduler.branch(parent, len(live))
        if seq is not parent:
            seq.output_logprobs = list(parent.output_logprobs)
        picked.add(parent.seq_id)
        live.append((seq, token, lp, score))
    for seq, token, lp, score in live:
        seq.append_token(token)
        seq.cumulative_logprob = score
        seq.output_logprobs.append({token: lp})
    kept = {seq.seq_id for seq, *_ in live}
    for seq in request.seqs:
        if seq.seq_id not in kept:
            scheduler.finish(seq)
    request.seqs = [seq for seq, *_ in live] if live else request.beam.results()


def start(request: Request, eos_token_ids: tuple[int, ...]) -> None:
    """Make `request` (whose params carry beam_search) a beam search: its first draw holds the seats of all
    its beams, as an n > 1 request's does until it forks (parallel_sampling.py)."""
    params = request.params.beam_search
    request.beam = BeamSearch(params, eos_token_ids, request.params.n, request.params.max_tokens)
    request.seqs[0].num_samples = params.beam_width
