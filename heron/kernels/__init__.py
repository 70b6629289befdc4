"""Heron's own Triton kernels, one per file (paged decode and prefill attention, the decode GEMV, the fused
elementwise ops, sampling, the mixture of experts' routing and grouped GEMMs), their PyTorch references in one
place (reference.py: what the CPU runs and the tests' oracle), and the matmul door (gemm/). Nothing here imports
the layers or models above it.

Importing this package, reference.py or gemm/ (but its linear.py) does not import Triton; import the kernel
modules (`heron.kernels.paged_decode`, ...) where Triton is installed.
"""
