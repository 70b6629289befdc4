#!/usr/bin/env bash
# A/B of one `heron` command between two source trees on the same machine, interleaved A B A B ...: device
# machines differ by a few % from call to call (the same engine once ran the offline Qwen3-8B workload
# at 9,265 and 9,539 tokens/s in two calls), so a change is timed against its parent inside one call.
#
#   git archive --format=tar --prefix=a/ <base commit> > .ab-a.tar
#   git archive --format=tar --prefix=b/ HEAD > .ab-b.tar      # carry both, then on the device:
#   tar xf .ab-a.tar -C /tmp && tar xf .ab-b.tar -C /tmp
#   bash benchmarks/ab.sh /tmp/a /tmp/b 2 bench throughput --model /tmp/shapes/qwen3-8b --load-format dummy ...
#
# Arguments: two or more source trees (directories), rounds, then the `heron` CLI arguments. Prints each run's
# first "Heron" result row (the throughput or latency table's) or, failing that, its last line; each run's log goes to
# $OUT/ab-<tree>-<round>.log.
set -u
TREES=(); while [ -d "$1" ]; do TREES+=("$1"); shift; done
ROUNDS=$1; shift
OUT=${OUT:-/tmp/heron-out}; mkdir -p "$OUT"
for round in $(seq "$ROUNDS"); do
  for tree in "${TREES[@]}"; do
    log="$OUT/ab-$(basename "$tree")-$round.log"
    (cd "$tree" && PYTHONPATH="$tree:${SITE:-/tmp/site}" python3 -m heron.entrypoints.cli "$@") > "$log" 2>&1
    row=$(grep -aE "^\| Heron[ ,]" "$log" | head -1)
    echo "$(basename "$tree") round $round: ${row:-$(tail -1 "$log")}"
  done
done
