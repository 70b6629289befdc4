"""Heron's own Triton kernels (paged decode and prefill attention, the decode GEMV, fused elementwise ops).

Importing this package does not import Triton; import the submodules (`heron.kernels.paged_decode`,
`heron.kernels.paged_prefill`, ...) where Triton is installed.
"""
