#!/bin/bash
# A/B of the four-heads kernels of partial heads at 72 registers (rb-72) and 64 (rb-new), in
# one call, alternated twice: rope-bench's fused prefill rows at rotary 64 of 128.
B=$(cd "$(dirname "$0")" && pwd)
for v in 72 new; do xz -d -c "$B/rb-$v.xz" > /tmp/rb-$v && chmod +x /tmp/rb-$v; done
cd /tmp
for round in 1 2; do for v in 72 new; do
  ROPE_BENCH_FUSED_ROTARY=64 timeout 100 /tmp/rb-$v --only fused-prefill --json "$OUT/ab-$v-$round.json" > "$OUT/ab-$v-$round.txt" 2>&1
  echo "== $v round $round rc=$?"; grep -E "^(norm|rope)" "$OUT/ab-$v-$round.txt" | grep -v PDL
done; done
