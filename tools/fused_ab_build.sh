#!/bin/sh
# Packs this tree's kernels as one build of a same-call A/B of the fused bench (tools/fused_ab.sh):
# sh tools/fused_ab_build.sh NAME [tests] writes ab/rope-bench-NAME.xz (and, with `tests`,
# ab/rope-tests-NAME.xz, the GPU test executable). ab/ is for `carry`; keep it out of git (for
# example in .git/info/exclude).
set -e
cd "$(dirname "$0")/.."
mkdir -p ab
cargo xtask ptx
cargo build --release -p rope-demo --bin rope-bench
xz -T0 -c target/release/rope-bench > "ab/rope-bench-$1.xz"
if [ "$2" = tests ]; then
  cargo test --release -p rope-tests --no-run
  exe=$(ls -t target/release/deps/rope-* | grep -v '\.d$' | head -1)
  xz -T0 -c "$exe" > "ab/rope-tests-$1.xz"
fi
