#!/bin/bash
# Same-call A/B of fused builds packed by tools/fused_ab_build.sh, on the GPU machine (device
# tool, carry ["ab"]): each spec runs once per round, two rounds, in the order given.
#   S="BUILD:SINCOS[:HEADS] ..."  prefill only (rope-bench --only fused-prefill); SINCOS is table
#                                 or computed, HEADS pins ROPE_BENCH_FUSED_KERNELS (4, rows, ...)
#   D="BUILD:SINCOS ..."          decode and prefill (--only fused), one round
#   T="BUILD ..."                 the fused GPU tests (their cases spread over every kernel choice)
# JSON (and the logs of failed runs) go to $OUT/j; the last lines are tools/fused_ab.py's summary.
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$OUT/j"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
for b in $(echo $S $T $D | tr ' ' '\n' | cut -d: -f1 | sort -u); do
  xz -dc "ab/rope-bench-$b.xz" > "/tmp/rb-$b" && chmod +x "/tmp/rb-$b"
  if [ -f "ab/rope-tests-$b.xz" ]; then
    xz -dc "ab/rope-tests-$b.xz" > "/tmp/rt-$b" && chmod +x "/tmp/rt-$b"
  fi
done
for t in $T; do
  log="$OUT/t-$t.log"
  "/tmp/rt-$t" fused > "$log" 2>&1
  echo "tests $t rc=$? $(grep -E '^test result' "$log" | tail -1)"
done
sincos() { [ "$1" = table ] && echo table || echo computed; }
for round in 1 2; do
  for spec in $S; do
    IFS=: read -r b sc heads <<< "$spec"
    name="$OUT/j/$b-$sc${heads:+-$heads}-$round"
    if env ROPE_BENCH_FUSED_SINCOS="$(sincos "$sc")" ${heads:+ROPE_BENCH_FUSED_KERNELS=$heads} \
      "/tmp/rb-$b" --only fused-prefill --json "$name.json" > "$name.log" 2>&1; then
      rm "$name.log"
    else
      echo "FAIL $spec (see $name.log)"
    fi
  done
done
for spec in $D; do
  IFS=: read -r b sc <<< "$spec"
  name="$OUT/j/$b-$sc-full"
  if ROPE_BENCH_FUSED_SINCOS="$(sincos "$sc")" "/tmp/rb-$b" --only fused --json "$name.json" \
    > "$name.log" 2>&1; then
    rm "$name.log"
  else
    echo "FAIL $spec (see $name.log)"
  fi
done
python3 tools/fused_ab.py $(ls -tr "$OUT"/j/*.json 2>/dev/null)
