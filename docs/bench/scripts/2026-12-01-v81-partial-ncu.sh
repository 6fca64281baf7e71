#!/bin/bash
# Issue 54 evidence (not product code): ncu of rope-bench's fused prefill "norm + rope" (whole
# heads, four-heads kernel) against "norm + rope, half rotary" (the four-heads kernel of
# partial heads): the first prefill launch of each after the decode shape's.
P=$(cd "$(dirname "$0")" && pwd)
xz -d -c "$P/rb-new.xz" > /tmp/rb && chmod +x /tmp/rb
M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__occupancy_limit_registers,launch__grid_size,launch__block_size,smsp__inst_executed.sum,smsp__issue_active.avg.per_cycle_active,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__thread_inst_executed_per_inst_executed.ratio,dram__bytes_read.sum,dram__bytes_write.sum,local_load_store:l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum
M=${M/local_load_store:/}
for k in rope_fused_neox_theta_bf16_four_heads rope_fused_neox_theta_bf16_four_heads_partial; do
  echo "== $k"
  cd /tmp && timeout 200 ncu --kernel-name "$k" --launch-skip 30 --launch-count 1 --metrics $M /tmp/rb --only fused-prefill --json /tmp/p.json > /tmp/ncu-$k.txt 2>&1
  grep -E "^ +[a-z_]+__|launch__" /tmp/ncu-$k.txt | sed 's/  */ /g' | head -30
done
