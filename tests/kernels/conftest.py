"""Kernel tests run on CUDA when there is a GPU, else on CPU tensors under Triton's interpreter
(TRITON_INTERPRET=1, set here before any kernel module is imported: Triton reads it when it decorates a
kernel). Without Triton every test here is skipped."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _fix_interpreter_for_numpy_2_4() -> None:
    """Triton 3.6's interpreter turns a scalar into a Python int with `int(array)`, which numpy >= 2.4 refuses
    for its shape-(1,) scalars (triton-lang/triton#9171, fixed upstream after 3.6): every loop with a
    data-dependent bound fails. Re-patch the interpreter's tensor `__index__` to go through one element."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    orig = getattr(interpreter, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_heron_fixed", False):
        return

    def _patch_lang_tensor(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _patch_lang_tensor._heron_fixed = True
    interpreter._patch_lang_tensor = _patch_lang_tensor


_fix_interpreter_for_numpy_2_4()
