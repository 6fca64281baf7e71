#!/bin/sh
# Nsight Compute on one launch of a representative kernel per bench row family, on the GPU
# machine next to an unpacked or packed gpu-bundle/ (cargo xtask gpu-bundle): sh tools/ncu_rows.sh
cd "$(dirname "$0")/../gpu-bundle" && sh run.sh --unpack || exit 1
S="--section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --section InstructionStats"
prof() { # case kernel-regex label
  echo "=== $3"
  ncu $S -k "regex:$2" --launch-skip 3 -c 1 ./rope-bench --only "$1" --json /dev/null 2>&1 \
   | grep -E "^  [a-z_0-9]+|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Executed Instructions  |Issued Ipc|Warp Cycles Per Issued|Avg. Active Threads|Block Limit Reg|One or More Eligible|Stall|long scoreboard|L1TEX|lg_throttle" | head -30
}
prof prefill '^rope_neox_table_bf16$' "prefill NeoX bf16 table (wide kernel)"
prof prefill '^rope_interleaved_theta_bf16$' "prefill interleaved bf16 computed"
prof training '^rope_neox_theta_f32$' "training f32 NeoX computed"
prof partial '^rope_neox_table_bf16$' "partial rotary 64/128 NeoX bf16 table"
prof strided '^rope_neox_table_bf16$' "strided views NeoX bf16 table"
prof decode '^rope_neox_table_bf16_one_head$' "decode NeoX bf16 table (one-head kernel)"
prof prefill '^rope_bench_copy1$' "the bench's PTX copy kernel (16 B per thread)"
prof fused-prefill '^rope_fused_neox_theta_bf16$' "fused norm + rope prefill"
