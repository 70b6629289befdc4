"""The building blocks of the model files. Each module owns its computation and picks its ops for the device it
sits on when it is built or moved (device_ops.py): Heron's Triton kernels and the matmul door
(heron/kernels/gemm) on CUDA, their PyTorch references (heron/kernels/reference.py) elsewhere.

- layernorm.py        RMSNorm (with the pre-norm residual add); NormLinear, an RMSNorm fused with the projection
                      it feeds (one GEMV kernel at decode sizes)
- linear.py           the tensor-parallel projections: ColumnParallelLinear (q/k/v, gate/up), RowParallelLinear
                      (o, down; optionally with SwiGLU's activation as its prologue); ReplicatedLinear (a router)
- moe.py              FusedMoE: the routed experts of a mixture-of-experts MLP, stacked (one grouped GEMM per
                      projection on CUDA)
- vocab_embedding.py  VocabParallelEmbedding and ParallelLMHead (float32 logits)
- rotary.py           the rotary embedding (optionally after a per-head q/k norm), writing K/V into the paged cache
"""
