"""Ops chosen once per device, not per call."""

from __future__ import annotations

from torch import nn


class DeviceOps(nn.Module):
    """A module that picks its ops (Triton kernels on CUDA, PyTorch references elsewhere) for the device its
    tensors sit on in `bind_ops`: when it is built (on `meta` too), and again whenever it is moved or cast, since
    `.to`, `.cuda`, `.half` and `to_empty` all go through `_apply` (as PyTorch's own RNN modules re-flatten
    their weights there). A forward then calls what was bound, with no device test or import of its own."""

    def bind_ops(self) -> None:
        raise NotImplementedError

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.bind_ops()
        return self
