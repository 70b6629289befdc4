"""Heron's own Triton kernels (paged KV write, paged decode and prefill attention).

Importing this package does not import Triton; import the submodules (`heron.kernels.kv_write`,
`heron.kernels.paged_decode`, `heron.kernels.paged_prefill`) where Triton is installed.
"""
