#!/usr/bin/env bash
# Everything Heron checks and times on the GPU, in one device call (the device tool runs it from the repo
# root; results land in $OUT). Sections run independently: a failure is logged and the next one runs.
#   bash benchmarks/gpu_check.sh [sections...]   (default: all)
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/heron-out}; mkdir -p "$OUT" /tmp/shapes
python3 benchmarks/shapes.py /tmp/shapes
SECTIONS=${*:-machine kernels gemv correctness latency throughput prefill serve}
# the embedded model's tokenizer where its package is absent (the device image): carried, for the tests' tiny
# models (tests/conftest.py) and the structured workload
[ -n "${STRUCTURED_TOKENIZER:-}" ] && export HERON_TEST_TOKENIZER=${HERON_TEST_TOKENIZER:-$STRUCTURED_TOKENIZER}
heron() { python3 -m heron.entrypoints.cli "$@"; }
# The device returns at most 8 files from $OUT: the logs go to $LOGS, and after each run the logs and the records
# are bundled into $OUT/results.tgz (so a call cut short by its timeout still brings back what ran).
LOGS=${LOGS:-/tmp/heron-logs}; mkdir -p "$LOGS"
START=$(mktemp); touch "$START"  # the records newer than this are this call's: an H100's get `-h100` (name_by_gpu.py)
bundle() { python3 benchmarks/name_by_gpu.py "$START"; tar czf "$OUT/results.tgz" benchmarks/results -C "$(dirname "$LOGS")" "$(basename "$LOGS")"; }
run() { local name=$1; shift; echo "=== $name: $*"; local t=$SECONDS
        ( "$@" ) 2>&1 | tee "$LOGS/$name.log"; echo "=== $name took $((SECONDS - t)) s (exit ${PIPESTATUS[0]})"; bundle; }
# the trees of an A/B (`git archive --prefix=a/`, `b/`, ... into .ab-a.tar, .ab-b.tar, ..., carried) as /tmp/a,
# /tmp/b, ... in TREES; AB_TREES names them (default "a b": a warm machine may keep an earlier call's tars)
ab_trees() { TREES=(); for n in ${AB_TREES:-a b}; do rm -rf /tmp/$n && tar xf .ab-$n.tar -C /tmp && TREES+=(/tmp/$n); done; }
for s in $SECTIONS; do case $s in
  machine) run machine nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv ;;
  kernels) run kernels python3 -m heron.bench.kernels ;;
  correctness) run correctness python3 benchmarks/gpu_correctness.py /tmp/shapes ;;
  kernel-tests) run kernel-tests python3 -m pytest -q -p no:cacheprovider tests/kernels tests/attention tests/layers ;;
  quick-tests)  # the GPU-only fused-op, GEMV and attention tests (all of kernel-tests takes ~5 min), the float8
    # GEMV and quantization kernel, the LoRA kernel's split-K, the cascade's mixed steps
    run quick-tests python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gemv.py tests/kernels/test_fused_ops.py \
        tests/kernels/test_triton_attention.py tests/kernels/gemm/test_fp8_quant.py tests/kernels/test_lora.py \
        tests/kernels/test_cascade.py -k "prologue or graph or shapes or rope or counters or fp8 or quantize or split or mixed" ;;
  graph-tests)  # CUDA graphs of prefill and mixed steps: engine outputs against enforce_eager, padded attention
    run graph-tests python3 -m pytest -q -p no:cacheprovider tests/executor/test_model_runner.py \
        tests/executor/test_graph_keys.py tests/kernels/test_triton_attention.py tests/kernels/gemm/test_tune.py \
        tests/layers/test_linear.py -k "graph or cuda" ;;
  gemv)  # the decode GEMV: its tests on the GPU, then its timings against cuBLAS (add --sweep to tune)
    run gemv-tests python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gemv.py
    run gemv-bench python3 -m heron.bench.kernels --gemv ;;
  embed-tests)  # issue 21: LLM.embed on the GPU (float32, eager) against transformers on the CPU
    run embed-tests python3 -m pytest -q -p no:cacheprovider tests/entrypoints/test_llm_embed.py ;;
  gemv-sweep) run gemv-sweep python3 -m heron.bench.kernels --gemv --sweep ;;
  gemv-moe) run gemv-moe python3 -m heron.bench.kernels --gemv --sweep --only 30b --rows 1 ;;  # issue 22's dense GEMVs
  gemv-fp8) run gemv-fp8 python3 -m heron.bench.kernels --gemv --fp8 --sweep --only llama ;;  # issue 24's batch 1
  prefill-sweep) run prefill-sweep python3 -m heron.bench.kernels --prefill-only --sweep ;;
  decode-sweep) run decode-sweep python3 -m heron.bench.kernels --decode-only --sweep ;;
  blas-probe) run blas-probe python3 benchmarks/blas_probe.py ;;  # cuBLAS / cuBLASLt / TunableOp per projection
  cublaslt-probe) run cublaslt-probe python3 benchmarks/cublaslt_probe.py ;;  # cuBLASLt's other candidates
  cublaslt-search)  # every configuration of the candidates' algorithms; the winners into the tree's table
    run cublaslt-search timeout "${CUBLASLT_TIMEOUT:-420}" python3 benchmarks/cublaslt_probe.py --search \
        --shapes qkv,o,gate_up,down --table heron/kernels/gemm/cublaslt_table.json ${CUBLASLT_ROWS:-$(seq 64 8 256)}
    cp heron/kernels/gemm/cublaslt_table.json "$OUT/" ;;
  moe)  # issue 22: Qwen3-30B-A3B (128 experts, 8 a token) offline (>= 0.6 of the limit counting the experts a
    # step reads) and at batch 1 (>= 0.7 of the active weight bytes / copy rate)
    run offline-qwen3-30b-a3b heron bench throughput --model /tmp/shapes/qwen3-30b-a3b --load-format dummy \
        --save-result --result-name offline-qwen3-30b-a3b --max-model-len 4096
    run latency-qwen3-30b-a3b heron bench latency --model /tmp/shapes/qwen3-30b-a3b --load-format dummy \
        --save-result --result-name latency-qwen3-30b-a3b-bs1 --max-model-len 4096 ;;
  moe-tests)  # the fused MoE kernels on the GPU (real shapes, graph replay) and their timings per token count,
    # then the engine against transformers on Qwen3-30B-A3B's shapes cut to 4 layers (fp32 greedy, bf16 logits)
    run moe-tests python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fused_moe.py \
        tests/kernels/test_moe_gemv.py tests/kernels/test_moe_routing.py
    run moe-bench python3 -m heron.bench.kernels --moe
    run moe-correctness python3 benchmarks/gpu_correctness.py /tmp/shapes qwen3-30b-a3b ;;
  sliding)  # issue 22: Mistral's out-of-window KV blocks released (block_manager.py) under the Triton kernels:
    # transformers parity past the window, and two ~90-token sequences in an 8-block pool
    run sliding python3 -m pytest -q -p no:cacheprovider tests/models/test_parity.py -k "window or pool" ;;
  moe-sweep) run moe-sweep python3 -m heron.bench.kernels --moe --sweep ;;  # configs for fused_moe.CONFIGS
  quant)  # issue 24: FP8 (per-channel weights; the float8 GEMV up to 16 rows, per-token activation quantization and
    # torch._scaled_mm past them): the kernel and checkpoint tests on the GPU, Qwen3-8B offline bf16, then FP8 weights
    # (w8a8), then FP8 weights and KV cache (the issue's `offline-qwen3-8b-fp8`) in the same call, Llama-3.1-8B at
    # batch 1 bf16 then FP8; QUANT_RECORDS_ONLY=1 skips the tests (the records again at an unchanged commit)
    if [ "${QUANT_RECORDS_ONLY:-0}" != 1 ]; then
      run quant-tests python3 -m pytest -q -p no:cacheprovider tests/kernels/gemm/test_fp8.py \
          tests/kernels/gemm/test_fp8_quant.py tests/models/test_quantization.py
      run gemv-fp8-tests python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gemv.py -k fp8
    fi
    run latency-llama heron bench latency --model /tmp/shapes/llama3.1-8b --load-format dummy \
        --save-result --result-name latency-llama3.1-8b-bs1 --max-model-len 4096
    run offline-qwen3-8b heron bench throughput --model /tmp/shapes/qwen3-8b --load-format dummy \
        --save-result --result-name offline-qwen3-8b --max-model-len 4096
    run offline-qwen3-8b-w8a8 heron bench throughput --model /tmp/shapes/qwen3-8b --load-format dummy \
        --quantization fp8 --save-result --result-name offline-qwen3-8b-w8a8 --max-model-len 4096
    run offline-qwen3-8b-fp8 heron bench throughput --model /tmp/shapes/qwen3-8b --load-format dummy \
        --quantization fp8 --kv-cache-dtype fp8 --save-result --result-name offline-qwen3-8b-fp8 --max-model-len 4096
    run latency-llama-fp8 heron bench latency --model /tmp/shapes/llama3.1-8b --load-format dummy \
        --quantization fp8 --save-result --result-name latency-llama3.1-8b-fp8-bs1 --max-model-len 4096 ;;
  fp8kv)  # issue 24 item 2: the float8 KV cache. Its kernel tests on the GPU (rotary write, decode, prefill, cascade,
    # both backends; the engine with CUDA graphs against enforce_eager), then Qwen3-8B offline with the bf16 cache and
    # the fp8 one: the default workload, and 4k-token sequences (3584 + 512) at up to 512 at once, where the pool
    # bounds the batch. Each record's kv_cache_tokens / 4096 is its capacity in 4k-token sequences (expect ~2x).
    # FP8KV_DEFAULT=0 skips the default workload's pair (`quant` measures FP8 weights with the fp8 cache there).
    run fp8kv-tests python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_kv.py \
        tests/engine/test_fp8_kv_cache.py
    for kv in auto fp8; do
      [ "${FP8KV_DEFAULT:-1}" = 1 ] && run offline-qwen3-8b-kv-$kv heron bench throughput \
          --model /tmp/shapes/qwen3-8b --load-format dummy \
          --kv-cache-dtype $kv --save-result --result-name offline-qwen3-8b-kv-$kv --max-model-len 4096
      run offline-qwen3-8b-4k-kv-$kv heron bench throughput --model /tmp/shapes/qwen3-8b --load-format dummy \
          --kv-cache-dtype $kv --input-len-range 3584,3584 --output-len-range 512,512 --num-prompts 512 \
          --max-num-seqs 512 --save-result --result-name offline-qwen3-8b-4k-kv-$kv --max-model-len 4096
    done ;;
  int4)  # issue 24: int4 weight-only (W4A16 Triton kernel): its tests and the checkpoint tests on the GPU, the
    # kernel against bf16 cuBLAS per Llama-3.1-8B projection and row count, Llama-3.1-8B AWQ-shaped at batch 1
    run int4-tests python3 -m pytest -q -p no:cacheprovider tests/kernels/gemm/test_int4.py \
        tests/models/test_int4_checkpoints.py
    run int4-probe python3 benchmarks/int4_probe.py ${INT4_SWEEP:+--sweep}  # INT4_SWEEP=1: the GEMV's tiles too
    run latency-llama-int4 heron bench latency --model /tmp/shapes/llama3.1-8b-awq --load-format dummy \
        --save-result --result-name latency-llama3.1-8b-int4-bs1 --max-model-len 4096 ;;
  lora)  # issue 25: the gathered LoRA kernel and the engine with it against peft (float32) on the GPU, then the
    # offline Qwen3-8B workload with 8 random rank-16 adapters (every projection) assigned round robin vs the base
    # model alone, same call (`lora-qwen3-8b`, ratio_vs_base >= 0.8); the adapters from benchmarks/make_loras.py;
    # LORA_RECORDS_ONLY=1 skips the tests (~4 minutes; the records alone take ~5), LORA_OFFLINE_ONLY=1 the batch-1 pair
    python3 benchmarks/make_loras.py /tmp/shapes/qwen3-8b /tmp/loras-qwen3-8b --num 8 --rank 16 > /dev/null
    [ "${LORA_RECORDS_ONLY:-0}" != 1 ] && run lora-tests python3 -m pytest -q -p no:cacheprovider \
        tests/kernels/test_lora.py tests/layers/test_lora.py tests/entrypoints/test_llm_lora.py \
        tests/kernels/test_gemv.py tests/kernels/gemm/test_linear.py
    run lora-qwen3-8b heron bench throughput --model /tmp/shapes/qwen3-8b --load-format dummy --max-model-len 4096 \
        --enable-lora --max-loras 8 --max-lora-rank 16 --lora-adapters /tmp/loras-qwen3-8b/lora* --no-limit \
        --save-result --result-name lora-qwen3-8b
    [ "${LORA_OFFLINE_ONLY:-0}" = 1 ] && continue  # the offline pair alone
    # batch-1 decode with one adapter against the base model (issue 25: <= 15% more ms/token)
    run latency-qwen3-8b heron bench latency --model /tmp/shapes/qwen3-8b --load-format dummy --max-model-len 4096 \
        --save-result --result-name latency-qwen3-8b-bs1
    run latency-lora-qwen3-8b heron bench latency --model /tmp/shapes/qwen3-8b --load-format dummy \
        --max-model-len 4096 --enable-lora --max-lora-rank 16 --lora-adapter /tmp/loras-qwen3-8b/lora0 \
        --save-result --result-name latency-lora-qwen3-8b-bs1 ;;
  profile) run profile python3 benchmarks/gpu_profile.py /tmp/shapes/qwen3-0.6b ;;
  profile-many) run profile-many python3 benchmarks/gpu_profile.py /tmp/shapes/qwen3-0.6b many ;;  # issue 23
  gpu-monitor)  # issue 28: the offline 0.6B workload with what the GPU did beside it (NVML, nvidia-ml-py)
    run offline-gpumon-qwen3-0.6b heron bench throughput --model /tmp/shapes/qwen3-0.6b --load-format dummy \
        --gpu-monitor --save-result --result-name offline-gpumon-qwen3-0.6b ;;
  profile-8b) run profile-8b python3 benchmarks/gpu_profile.py /tmp/shapes/qwen3-8b ;;
  profile-prefix) run profile-prefix python3 benchmarks/gpu_profile.py /tmp/shapes/qwen3-0.6b prefix ;;  # issue 26
  profile-lora)  # issue 25: the LoRA workload's timeline, kernels of its decode steps at 256, 128 and 1, two prefills
    python3 benchmarks/make_loras.py /tmp/shapes/qwen3-8b /tmp/loras-qwen3-8b --num 8 --rank 16 > /dev/null
    run profile-lora python3 benchmarks/gpu_profile.py /tmp/shapes/qwen3-8b lora /tmp/loras-qwen3-8b/lora* ;;
  profile-structured)  # issue 20: the structured workload's timeline, kernels and idle gaps of its decode steps
    TOK=${STRUCTURED_TOKENIZER:-/tmp/shapes/smollm2-tokenizer}
    [ -d "$TOK" ] || python3 -c "from heron.models.loader import load_source; load_source(None).tokenizer.save_pretrained('$TOK')"
    run profile-structured python3 benchmarks/gpu_profile.py /tmp/shapes/qwen3-0.6b structured "$TOK" ;;
  profile-fp8)  # issue 24: Qwen3-8B with FP8 weights: its kernels at batch 256 and 1, and the offline timeline
    run profile-fp8 python3 benchmarks/gpu_profile.py /tmp/shapes/qwen3-8b fp8 kernels timeline ;;
  profile-fp8kv)  # issue 24: Qwen3-8B's kernels at batch 256 and 1 with FP8 weights, bf16 cache then float8 cache
    run profile-fp8-kv-auto python3 benchmarks/gpu_profile.py /tmp/shapes/qwen3-8b fp8 kernels
    run profile-fp8-kv-fp8 python3 benchmarks/gpu_profile.py /tmp/shapes/qwen3-8b fp8 kvfp8 kernels ;;
  profile-int4)  # issue 24: Llama-3.1-8B AWQ-shaped (int4 weights): its kernels at batch 256 and 1
    run profile-int4 python3 benchmarks/gpu_profile.py /tmp/shapes/llama3.1-8b-awq kernels ;;
  ncu-gemv)  # issue 24: the batch-1 MLP matmuls (int4, float8, bf16 GEMVs) under Nsight Compute: DRAM throughput
    # against the busiest pipe and the warps' stall reasons (benchmarks/ncu_gemv.py)
    run ncu-gemv ncu --clock-control none --kernel-name regex:gemv --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section InstructionStats python3 benchmarks/ncu_gemv.py ;;
  ncu-moe)  # issue 22: a Qwen3-30B-A3B layer's batch-1 GEMVs and MoE kernels under Nsight Compute (benchmarks/ncu_moe.py)
    run ncu-moe ncu --clock-control none --kernel-name regex:"gemv|_up_kernel|_down_kernel" --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats --section Occupancy \
        python3 benchmarks/ncu_moe.py ;;
  profile-moe)  # issue 22: Qwen3-30B-A3B's batch-1 and batch-256 phases, and its kernels at both batch sizes
    run profile-moe python3 benchmarks/gpu_profile.py /tmp/shapes/qwen3-30b-a3b phases kernels ;;
  lora-act) run lora-act python3 benchmarks/lora_probe.py act ;;  # issue 25: gate/up's expand inside the activation
  lora-probe) run lora-probe python3 benchmarks/lora_probe.py ;;  # issue 25: the shrink's and expand's tiles, swept
  lora-row) run lora-row python3 benchmarks/lora_probe.py row ;;  # issue 25: batch 1's GEMVs with the adapter and without
  leak-probe)  # two engines in one process, as `lora`'s offline record built them before its arms got processes of
    # their own: the process's GPU memory segments as each engine places its weights and sizes its KV cache (~2 min)
    python3 benchmarks/make_loras.py /tmp/shapes/qwen3-8b /tmp/loras-qwen3-8b --num 8 --rank 16 > /dev/null
    run leak-probe python3 benchmarks/leak_probe.py --model /tmp/shapes/qwen3-8b --load-format dummy \
        --max-model-len 4096 --enable-lora --max-loras 8 --max-lora-rank 16 --lora-adapters /tmp/loras-qwen3-8b/lora* \
        --no-limit ${LEAK_ARGS:-} ;;
  latency)
    run latency-qwen3 heron bench latency --model /tmp/shapes/qwen3-0.6b --load-format dummy --save-result \
        --result-name latency-qwen3-0.6b-bs1
    run latency-llama heron bench latency --model /tmp/shapes/llama3.1-8b --load-format dummy --save-result \
        --result-name latency-llama3.1-8b-bs1 --max-model-len 4096 ;;
  throughput)
    run offline-qwen3-0.6b heron bench throughput --model /tmp/shapes/qwen3-0.6b --load-format dummy \
        --save-result --result-name offline-qwen3-0.6b
    run offline-qwen3-8b heron bench throughput --model /tmp/shapes/qwen3-8b --load-format dummy \
        --save-result --result-name offline-qwen3-8b --max-model-len 4096 ;;
  prefix)  # issue 26: 512 requests = 16 system prompts of 2,000 tokens x 32, each + its own 50-200 token question,
    # outputs [64, 256], ignore_eos, T 0.6; cascade attention on (>= 31,000 / 11,000 output tok/s), then off (the
    # Heron baselines, same run), then the plain offline records again (no regression); PREFIX_MODELS picks the
    # models, PREFIX_ONLY=1 skips the plain records
    P=(--load-format dummy --save-result --max-model-len 4096 --num-prompts 512 --shared-prefix-len 2000
       --num-shared-prefixes 16 --input-len-range 50,200 --output-len-range 64,256)
    for m in ${PREFIX_MODELS:-qwen3-0.6b qwen3-8b}; do
      run offline-prefix-$m heron bench throughput --model /tmp/shapes/$m "${P[@]}" --result-name offline-prefix-$m
      run offline-prefix-nocascade-$m heron bench throughput --model /tmp/shapes/$m "${P[@]}" \
          --disable-cascade-attn --result-name offline-prefix-nocascade-$m
    done
    [ "${PREFIX_ONLY:-0}" = 1 ] && continue  # the pairs alone (a change that cannot touch the plain records)
    run offline-qwen3-0.6b heron bench throughput --model /tmp/shapes/qwen3-0.6b --load-format dummy \
        --save-result --result-name offline-qwen3-0.6b
    run offline-qwen3-8b heron bench throughput --model /tmp/shapes/qwen3-8b --load-format dummy \
        --save-result --result-name offline-qwen3-8b --max-model-len 4096 ;;
  cascade-tests)  # issue 26: the cascade kernels against the plain decode kernel (tiny and production shapes), and
    # greedy engine outputs with cascade on = off (decode graphs captured with the cascade kernels)
    run cascade-tests python3 -m pytest -q -p no:cacheprovider tests/kernels/test_cascade.py ;;
  sass-probe) run sass-probe python3 benchmarks/sass_probe.py ;;  # the kernels' registers and spills, the image's ptxas
  mixed-prefill) run mixed-prefill python3 benchmarks/mixed_prefill_probe.py ;;  # issue 26: a mixed graph's prefill grid
  cascade-probe) run cascade-probe python3 benchmarks/cascade_probe.py ;;  # one layer: plain vs cascade, a sweep
  cascade-suffix) run cascade-suffix python3 benchmarks/cascade_probe.py suffix ;;  # the own-keys decode's tiles
  cascade-eager)  # issue 26: an eager mixed step's cascade launches, host time per call, with PDL and without
    run cascade-eager python3 benchmarks/cascade_probe.py eager
    HERON_PDL=0 run cascade-eager-nopdl python3 benchmarks/cascade_probe.py eager ;;
  throughput-8b)
    run offline-qwen3-8b heron bench throughput --model /tmp/shapes/qwen3-8b --load-format dummy \
        --save-result --result-name offline-qwen3-8b --max-model-len 4096 ;;
  many)  # issue 23: 20,000 and 100,000 short requests (prompts and outputs uniform [16, 64]) beside the 256-request
    # default, in one call: >= 26,000 output tokens/s at 20k, and 100k within 10% of 20k per token
    M=(--model /tmp/shapes/qwen3-0.6b --load-format dummy --save-result)
    S=(--input-len-range 16,64 --output-len-range 16,64 --max-model-len 4096 --no-limit)
    run offline-qwen3-0.6b heron bench throughput "${M[@]}" --result-name offline-qwen3-0.6b
    run offline-many-qwen3-0.6b heron bench throughput "${M[@]}" "${S[@]}" --num-prompts 20000 \
        --result-name offline-many-qwen3-0.6b
    run offline-many100k-qwen3-0.6b heron bench throughput "${M[@]}" "${S[@]}" --num-prompts 100000 \
        --result-name offline-many100k-qwen3-0.6b ;;
  many-8b)
    run offline-many-qwen3-8b heron bench throughput --model /tmp/shapes/qwen3-8b --load-format dummy \
        --max-model-len 4096 --save-result --input-len-range 16,64 --output-len-range 16,64 --no-limit \
        --num-prompts 20000 --result-name offline-many-qwen3-8b ;;
  throughput-hf)  # the 0.6B record with transformers generate on 32 of the requests (ratio_vs_hf >= 10)
    run offline-qwen3-0.6b heron bench throughput --model /tmp/shapes/qwen3-0.6b --load-format dummy \
        --save-result --result-name offline-qwen3-0.6b --max-model-len 4096 --hf-baseline --hf-num-prompts 32 ;;
  structured)  # issue 20: the 0.6B workload with every request under a JSON schema vs unconstrained, same run
    # (heron/bench/structured.py; ratio_vs_unconstrained >= 0.9). The shapes' word-level tokenizers spell no JSON,
    # so the requests decode with the embedded SmolLM2 tokenizer (a real BPE vocabulary; ids past it are masked).
    # Where the embedded model's package is absent (the device image), carry its tokenizer: STRUCTURED_TOKENIZER=DIR.
    TOK=${STRUCTURED_TOKENIZER:-/tmp/shapes/smollm2-tokenizer}
    [ -d "$TOK" ] || python3 -c "from heron.models.loader import load_source; load_source(None).tokenizer.save_pretrained('$TOK')"
    run bitmask-tests python3 -m pytest -q -p no:cacheprovider tests/kernels/test_token_bitmask.py
    run structured-qwen3-0.6b heron bench throughput --model /tmp/shapes/qwen3-0.6b --load-format dummy \
        --tokenizer "$TOK" --structured-output json-schema --no-limit \
        --save-result --result-name structured-qwen3-0.6b --max-model-len 4096 ;;
  grammar-host)  # issue 20: the host's grammar work per step alone (accept, fill) with 1, 4 and 8 threads
    TOK=${STRUCTURED_TOKENIZER:-/tmp/shapes/smollm2-tokenizer}
    [ -d "$TOK" ] || python3 -c "from heron.models.loader import load_source; load_source(None).tokenizer.save_pretrained('$TOK')"
    run grammar-host python3 benchmarks/grammar_host.py --tokenizer "$TOK" --threads 1 4 8 ;;
  gemma)  # issue 22's dense half: the attention variants' and GeGLU's kernel tests on the GPU (Gemma 2's shapes:
    # head_dim 256, window, soft cap), Gemma 2 against transformers (fp32 greedy, bf16 logits, 128-token window),
    # then the offline workload on Gemma 2 9B's shapes (`offline-gemma2-9b`)
    run gemma-kernel-tests python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_attention.py \
        tests/kernels/test_fused_ops.py -k "variants or window or params or gelu or tile"
    run gemma-correctness python3 benchmarks/gpu_correctness.py /tmp/shapes gemma2-9b
    run offline-gemma2-9b heron bench throughput --model /tmp/shapes/gemma2-9b --load-format dummy \
        --save-result --result-name offline-gemma2-9b --max-model-len 4096 ;;
  gemma3)  # Gemma 3 12B's shapes offline (five sliding layers of 1024 to each global one)
    run offline-gemma3-12b heron bench throughput --model /tmp/shapes/gemma3-12b --load-format dummy \
        --save-result --result-name offline-gemma3-12b --max-model-len 4096 ;;
  prefill)  # issue 4: 8 x 2048 prompt tokens in the engine's default steps (8192 tokens), mfu >= 0.60
    run prefill-llama heron bench latency --prefill --model /tmp/shapes/llama3.1-8b --load-format dummy \
        --max-model-len 4096 --batch-size 8 --input-len 2048 --save-result --result-name prefill-llama3.1-8b ;;
  # Opt-in, with the FlashInfer wheels installed; FlashInfer JIT-compiles for minutes on a bare machine, so
  # each section restores and saves its built modules (benchmarks/flashinfer_cache.sh) and the build is
  # time-boxed to leave room for the save. Run them in separate device calls the first time.
  fi-build)  # FlashInfer's JIT builds in the background (nvcc on the CPUs, a tiny GPU run) while the next
    # sections run; kernels-vs-flashinfer waits for it
    . benchmarks/flashinfer_cache.sh
    timeout 480 python3 -m heron.bench.kernels --vs-flashinfer --batch 4 > "$LOGS/fi-build.log" 2>&1 &
    FI_BUILD=$! ;;
  kernels-vs-flashinfer)
    [ -n "${FI_BUILD:-}" ] && { wait "$FI_BUILD"; echo "fi-build exited $?"; FI_BUILD=; }
    . benchmarks/flashinfer_cache.sh
    run kernels-vs-flashinfer timeout 480 python3 -m heron.bench.kernels --vs-flashinfer --save-result
    fi_cache_save "$OUT" ;;
  flashinfer-tests)
    . benchmarks/flashinfer_cache.sh
    run flashinfer-tests timeout 480 python3 -m pytest -q -p no:cacheprovider \
        tests/attention/test_flashinfer_backend.py
    fi_cache_save "$OUT" ;;
  serve|serve-no-sweep)  # issue 5: served vs offline throughput on the same requests, then a rate sweep;
    # SERVE_ARGS adds engine flags to both (SERVE_ARGS="--max-num-seqs 256")
    M=/tmp/shapes/qwen3-0.6b; W=(--random-input-len 100,1024 --random-output-len 100,1024 --num-prompts 256
                                --seed 0 --ignore-eos --temperature 0.6 --tokenizer $M)
    run serve-offline heron bench throughput --model $M --load-format dummy --max-model-len 4096 ${SERVE_ARGS:-} \
        --save-result --result-name serve-qwen3-0.6b-offline
    python3 -m heron.entrypoints.cli serve $M --load-format dummy --max-model-len 4096 --port 8011 ${SERVE_ARGS:-} \
        > "$LOGS/serve-server.log" 2>&1 &
    SERVER=$!
    for _ in $(seq 300); do  # until healthy, or the server has exited
      python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8011/health')" 2>/dev/null && break
      kill -0 $SERVER 2>/dev/null || break; sleep 1; done
    # the offline record just written (an H100's has the suffix -h100: name_by_gpu.py)
    run serve-inf heron bench serve --base-url http://127.0.0.1:8011/v1 "${W[@]}" --request-rate inf \
        --disable-tqdm --offline-result "$(ls -t benchmarks/results/serve-qwen3-0.6b-offline*.json | head -1)" \
        --label serve-qwen3-0.6b --save-result
    [ "$s" = serve ] && run serve-sweep heron bench serve --base-url http://127.0.0.1:8011/v1 "${W[@]}" \
        --request-rate 8,32,inf --disable-tqdm --label serve-qwen3-0.6b --save-result --gpu-monitor
    kill -INT $SERVER; wait $SERVER; tail -5 "$LOGS/serve-server.log" ;;
  serve-prefix)  # issue 26: the prefix workload through the server's chat endpoint (the system prompts as system
    # messages; the shapes' tokenizers have no chat template: a ChatML one), cascade on; the offline run beside it
    M=/tmp/shapes/qwen3-0.6b
    W=(--num-prompts 512 --shared-prefix-len 2000 --num-shared-prefixes 16 --random-input-len 50,200
       --random-output-len 64,256 --seed 0 --ignore-eos --temperature 0.6 --tokenizer $M)
    printf '%s' "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}<|im_start|>assistant" \
        > /tmp/chatml.jinja
    python3 -m heron.entrypoints.cli serve $M --load-format dummy --max-model-len 4096 --port 8012 \
        --chat-template /tmp/chatml.jinja > "$LOGS/serve-prefix-server.log" 2>&1 &
    SERVER=$!
    for _ in $(seq 300); do
      python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8012/health')" 2>/dev/null && break
      kill -0 $SERVER 2>/dev/null || break; sleep 1; done
    run serve-prefix-inf heron bench serve --base-url http://127.0.0.1:8012/v1 --endpoint /v1/chat/completions \
        "${W[@]}" --request-rate inf --disable-tqdm --label serve-prefix-qwen3-0.6b --save-result
    kill -INT $SERVER; wait $SERVER; tail -5 "$LOGS/serve-prefix-server.log" ;;
  ab-attention)  # a change to the attention kernels timed against its parent in one call (benchmarks/ab.sh,
    # interleaved, AB_ROUNDS rounds): the trees from .ab-a.tar and .ab-b.tar (`git archive --prefix=a/` and `b/`,
    # carried), over the workloads whose steps differ in attention: the prefix workload (cascade, mixed steps
    # behind long cached prompts), the plain offline 0.6B one and 20,000 short requests (mixed steps every step);
    # AB_WORKLOADS picks among prefix, offline and many (a cascade-only change: prefix); AB_ARGS adds engine flags
    ab_trees
    M=(--model /tmp/shapes/qwen3-0.6b --load-format dummy --max-model-len 4096 ${AB_ARGS:-})
    P=(--num-prompts 512 --shared-prefix-len 2000 --num-shared-prefixes 16 --input-len-range 50,200
       --output-len-range 64,256)
    AB=(bash benchmarks/ab.sh "${TREES[@]}" "${AB_ROUNDS:-2}" bench throughput "${M[@]}")
    W=" ${AB_WORKLOADS:-prefix offline many} "
    [[ $W == *" prefix "* ]] && run ab-prefix env OUT="$LOGS/ab-prefix" "${AB[@]}" "${P[@]}"
    [[ $W == *" offline "* ]] && run ab-offline env OUT="$LOGS/ab-offline" "${AB[@]}"
    [[ $W == *" many "* ]] && run ab-many env OUT="$LOGS/ab-many" "${AB[@]}" --num-prompts 20000 \
        --input-len-range 16,64 --output-len-range 16,64 --no-limit ;;
  ab-lora)  # issue 25: changes to the LoRA kernels timed against their parent in one call (trees as ab-attention's),
    # AB_ROUNDS interleaved rounds of each workload AB_WORKLOADS names: bs1 (batch-1 decode with one rank-16 adapter
    # on Qwen3-8B's shapes), offline (`lora`'s offline workload with 8 adapters, each run with its base arm: the
    # rows are the adapters' arm, the logs hold each run's ratio_vs_base)
    ab_trees
    python3 benchmarks/make_loras.py /tmp/shapes/qwen3-8b /tmp/loras-qwen3-8b --num 8 --rank 16 > /dev/null
    M=(--model /tmp/shapes/qwen3-8b --load-format dummy --max-model-len 4096 --enable-lora --max-lora-rank 16)
    AB=(bash benchmarks/ab.sh "${TREES[@]}" "${AB_ROUNDS:-2}")
    W=" ${AB_WORKLOADS:-bs1} "
    [[ $W == *" bs1 "* ]] && run ab-lora env OUT="$LOGS/ab-lora" "${AB[@]}" bench latency "${M[@]}" \
        --lora-adapter /tmp/loras-qwen3-8b/lora0
    [[ $W == *" offline "* ]] && run ab-lora-offline env OUT="$LOGS/ab-lora-offline" "${AB[@]}" bench throughput \
        "${M[@]}" --max-loras 8 --lora-adapters /tmp/loras-qwen3-8b/lora* --no-limit ;;
  ab-latency)  # a change to the batch-1 chain (PDL, the GEMV, the MoE kernels) timed against its parent (trees as
    # ab-attention's): batch-1 decode of each of AB_MODELS (default: issue 22's MoE, then a dense 8B), AB_ROUNDS rounds;
    # --max-num-seqs 8: the same batch-1 graph, a quicker start (fewer graphs to capture and variants to compile)
    ab_trees
    for model in ${AB_MODELS:-qwen3-30b-a3b llama3.1-8b}; do
      run ab-latency-$model env OUT="$LOGS/ab-latency-$model" bash benchmarks/ab.sh "${TREES[@]}" "${AB_ROUNDS:-2}" \
          bench latency --model /tmp/shapes/$model --load-format dummy --max-model-len 4096 --max-num-seqs 8
    done ;;
  serve-dp2)  # issue 27, on 2 GPUs: one server with 2 data-parallel replicas vs one with 1, on the same requests
    # (target >= 1.9x); records serve-dp1-qwen3-0.6b and serve-dp2-qwen3-0.6b (with the ratio)
    M=/tmp/shapes/qwen3-0.6b; W=(--random-input-len 100,1024 --random-output-len 100,1024 --num-prompts 1024
                                --seed 0 --ignore-eos --temperature 0.6 --tokenizer $M)
    for DP in 1 2; do
      python3 -m heron.entrypoints.cli serve $M --load-format dummy --max-model-len 4096 --port 8012 \
          --data-parallel-size $DP > "$LOGS/serve-dp$DP-server.log" 2>&1 &
      SERVER=$!
      for _ in $(seq 300); do
        python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8012/health')" 2>/dev/null && break
        kill -0 $SERVER 2>/dev/null || break; sleep 1; done
      run serve-dp$DP heron bench serve --base-url http://127.0.0.1:8012/v1 "${W[@]}" --request-rate inf \
          --disable-tqdm --label serve-dp$DP-qwen3-0.6b --metadata data_parallel_size=$DP --save-result
      kill -INT $SERVER; wait $SERVER; tail -3 "$LOGS/serve-dp$DP-server.log"
    done
    run serve-dp2-ratio python3 -c "
import json; r = 'benchmarks/results/serve-dp%d-qwen3-0.6b.json'; one, two = (json.load(open(r % n)) for n in (1, 2))
two['metrics']['ratio_vs_one_replica'] = two['metrics']['output_tokens_per_s'] / one['metrics']['output_tokens_per_s']
json.dump(two, open(r % 2, 'w'), indent=2); print('2 replicas / 1:', two['metrics']['ratio_vs_one_replica'])" ;;
esac; done
bundle
ls -la "$OUT"
