# FlashInfer's kernels, built once and carried between device runs: FlashInfer JIT-compiles each variant it
# is asked for (dtype x head dim x decode / prefill kind) with nvcc on first use, minutes each, and every
# device run starts on a bare machine. Source this in the device command, after installing the wheels:
#
#   . benchmarks/flashinfer_cache.sh      # restore .fi_cache/modules.tgz (if carried), set FlashInfer's env
#   timeout 480 <tests / benchmarks>      # leave time for the save even when the build runs long
#   fi_cache_save                         # all modules, carried + built now, into $OUT/fi_modules.tgz.partNN
#
# Back on this machine, from the repo root: `cat <files_at>/fi_modules.tgz.part* > .fi_cache/modules.tgz`,
# then carry [".whl", ".fi_cache"] (".fi_cache/" is git-ignored).
#
# Where things go. FLASHINFER_WORKSPACE_BASE (0.6.x; default $HOME) is set to <repo>/.fi_cache/jit, so the
# JIT builds into
#   .fi_cache/jit/.cache/flashinfer/<version>/<arch, 90a on an H200>/cached_ops/<module>/<module>.so
# beside its .o files and build.ninja (the generated sources in .../generated/<module>/). That folder is not
# what is carried: FlashInfer always re-runs ninja on a JIT module, which rebuilds it when the freshly
# installed headers look newer than the objects. Only its AOT folder, <package>/data/aot/<module>/<module>.so,
# is loaded without ninja, so restore points that folder at the carried modules and save copies each newly
# built .so there. <module> names the variant: batch_decode_with_kv_cache_dtype_q_bf16_..._head_dim_qk_128_...
# (CUDA-core decode), batch_prefill_with_kv_cache_..._sm90 (prefill on an H200), the same without _sm90 (fa2:
# tensor-core decode).

FI_PKG=$(python3 -c "import importlib.util as u; s = u.find_spec('flashinfer')
print(s.submodule_search_locations[0] if s else '')")
if [ -z "$FI_PKG" ]; then
  echo "flashinfer_cache: flashinfer is not importable here; nothing restored" >&2
else
  FI_VERSION=$(python3 -c "from importlib.metadata import version; print(version('flashinfer-python'))")
  FI_AOT=/tmp/fi_aot/$FI_VERSION
  export FLASHINFER_WORKSPACE_BASE=$PWD/.fi_cache/jit
  mkdir -p "$FLASHINFER_WORKSPACE_BASE" "$FI_AOT"
  [ -f .fi_cache/modules.tgz ] && tar xzf .fi_cache/modules.tgz -C /tmp/fi_aot
  ln -sfnT "$FI_AOT" "$FI_PKG/data/aot"
  # FlashInfer runs `ninja` to drive nvcc; the ninja wheel, installed with --target, puts it in <target>/bin
  command -v ninja >/dev/null || export PATH=$(dirname "$FI_PKG")/bin:$PATH
  echo "flashinfer_cache: $(ls "$FI_AOT" | wc -l) carried module(s) in $FI_AOT;" \
       "JIT builds in $FLASHINFER_WORKSPACE_BASE"
fi

fi_cache_save() {
  [ -n "${FI_AOT:-}" ] || { echo "fi_cache_save: nothing restored, nothing to save" >&2; return 0; }
  local out=${1:-${OUT:-/tmp/heron-out}} so name new=0
  for so in "$FLASHINFER_WORKSPACE_BASE"/.cache/flashinfer/"$FI_VERSION"/*/cached_ops/*/*.so; do
    [ -e "$so" ] || continue
    name=$(basename "$so" .so)
    mkdir -p "$FI_AOT/$name" && cp "$so" "$FI_AOT/$name/" && new=$((new + 1))
  done
  echo "fi_cache_save: $new module(s) built this run"
  [ "$new" -gt 0 ] || return 0
  du -sh "$FI_AOT"/* | sort -h
  mkdir -p "$out"
  tar czf - -C /tmp/fi_aot "$FI_VERSION" | split -b 15m -d - "$out/fi_modules.tgz.part"
  ls -la "$out"/fi_modules.tgz.part*
}
