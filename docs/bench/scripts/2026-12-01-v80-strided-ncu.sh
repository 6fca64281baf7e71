#!/bin/bash
# Issue 53 evidence (not product code): ncu of rope-bench's strided rows' kernels (bf16, interleaved
# first: the group's first launches after its warm-up) against the training rows' (contiguous, out of place).
P=$(cd "$(dirname "$0")" && pwd)
xz -d -c "$P/rb-new.xz" > /tmp/rb && chmod +x /tmp/rb
M=dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size,launch__block_size,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__issue_active.avg.per_cycle_active,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_write.sum,dram__bytes_read.sum,dram__bytes_write.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum
for c in strided training; do
  echo "== $c"
  cd /tmp && timeout 100 ncu --kernel-name regex:"^rope_" --launch-skip 12 --launch-count 2 --metrics $M /tmp/rb --only $c --json /tmp/p.json > /tmp/ncu-$c.txt 2>&1; grep -E "Context [0-9]|__" /tmp/ncu-$c.txt | grep -v "registers," | sed 's/  */ /g' | head -40
done
