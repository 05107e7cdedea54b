#!/usr/bin/env bash
# Build and run one of the microbenchmarks of this folder (sm_90a: an H100 or H200), the rest of
# the command line passed to it: bash profiles/ubench/run.sh chain2|chain3|chain4|chain5|experts_ring|topk_stages|wgmma_gemv|wgmma_fp4 [ARGS]
set -euo pipefail
name=${1:?usage: run.sh chain2|chain3|chain4|chain5|experts_ring|topk_stages|wgmma_gemv|wgmma_fp4 [ARGS]}; shift
here=$(cd "$(dirname "$0")" && pwd)
[ -f "$here/$name.cu" ] || { echo "run.sh: no $name.cu in $here" >&2; exit 2; }
bin=${TMPDIR:-/tmp}/ubench_$name
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o "$bin" "$here/$name.cu"
nvidia-smi --query-gpu=name --format=csv,noheader
"$bin" "$@"
