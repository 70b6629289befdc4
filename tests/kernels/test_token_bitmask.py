"""Structured outputs' token mask (heron.kernels.token_bitmask) against its reference and xgrammar's own
apply, the layout's owner: random masks, a vocabulary that ends inside a word and inside a block, bans in the
sign bit, logits wider than the mask, and row counts that Triton would specialize had they been an argument."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
xgr = pytest.importorskip("xgrammar")

from heron.kernels.reference import apply_token_bitmask_ref  # noqa: E402
from heron.kernels.token_bitmask import BLOCK, _mask_kernel, apply_token_bitmask_  # noqa: E402
from tests.kernels.kernel_utils import pick_device, skip_unless_runnable  # noqa: E402

DEV = pick_device()

skip_unless_runnable(_mask_kernel, DEV)


def random_bitmask(rows: int, vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(allowed bool [rows, 32 * words], the int32 words xgrammar's layout packs it in)."""
    words = -(-vocab // 32)
    allowed = torch.rand(rows, 32 * words, generator=gen) < 0.5
    allowed[:, 31::32] = torch.rand(rows, words, generator=gen) < 0.5  # the sign bit, banned about half the time
    packed = (allowed.reshape(rows, words, 32).long() << torch.arange(32)).sum(-1)
    return allowed, torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_the_kernel_masks_as_the_reference_and_xgrammar(rows):
    gen = torch.Generator().manual_seed(rows)
    vocab = BLOCK + 37  # past one block, ending inside a word
    allowed, bitmask = random_bitmask(rows, vocab, gen)
    logits = torch.randn(rows, vocab, generator=gen)
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask, vocab_size=vocab)
    assert torch.equal(want.isfinite(), allowed[:, :vocab])
    assert torch.equal(apply_token_bitmask_ref(logits.clone(), bitmask), want)
    got = apply_token_bitmask_(logits.to(DEV), bitmask.to(DEV))
    assert torch.equal(got.cpu(), want)


def test_a_mask_with_fewer_rows_than_the_logits_is_refused():
    with pytest.raises(AssertionError, match="a mask row for every logits row"):
        apply_token_bitmask_(torch.zeros(4, 64, device=DEV), torch.zeros(1, 2, dtype=torch.int32, device=DEV))


def test_logits_wider_than_the_mask_keep_their_tail_and_extra_mask_rows_are_unused():
    gen = torch.Generator().manual_seed(0)
    _, bitmask = random_bitmask(4, 64, gen)  # 2 words: 64 tokens, 4 rows for 2 logits rows
    logits = torch.randn(2, 100, generator=gen)
    want = apply_token_bitmask_ref(logits.clone(), bitmask)
    assert want[:, 64:].isfinite().all() and torch.equal(want[:, 64:], logits[:, 64:])
    assert torch.equal(apply_token_bitmask_(logits.to(DEV), bitmask.to(DEV)).cpu(), want)
