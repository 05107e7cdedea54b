#!/usr/bin/env bash
# compute-sanitizer over a short FP8 run on one GPU: prefill of a 600-token prompt (the FP8
# tensor-core GEMMs, chunk kernels, compressors and indexer), plain decode, then speculative decode
# (verify rows, journal, MTP block), eager mode. initcheck (no kernel reads device memory nothing
# wrote; the caching allocator off, so every allocation starts uninitialized) on both runs, and
# racecheck (shared-memory hazards between warps) on the plain one. Exit 0 only when every tool
# reports 0 errors. Usage: scripts/sanitize.sh [WORKDIR]   (profiles/README.md)
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-/tmp/dsv4-sanitize}
mkdir -p "$work"
ckpt="$work/tiny-fp8"
[ -f "$ckpt/config.json" ] || python scripts/make_checkpoint.py --preset tiny --out "$ckpt" >/dev/null
ids=$(python -c "print(','.join(str((13 * i + 5) % 2000 + 3) for i in range(600)))")
run() {   # run TOOL NAME EXTRA_ARGS...
  local tool=$1 name=$2; shift 2
  echo "== $tool: $name"
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool "$tool" --error-exitcode 3 \
      --print-limit 20 --target-processes all \
      python scripts/decode.py --ckpt "$ckpt" --prompt-ids "$ids" --max-seq-len 1024 \
      --mode eager --device cuda:0 --json "$@" >"$work/$tool-$name.json" 2>"$work/$tool-$name.log" \
    || { tail -n 40 "$work/$tool-$name.log"; echo "$tool $name: FAILED (log: $work/$tool-$name.log)"; exit 1; }
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$work/$tool-$name.log" || true
}
run initcheck plain --max-new-tokens 8
run initcheck speculative --max-new-tokens 8 --speculative 1 --speculative-min-acceptance 0
run racecheck plain --max-new-tokens 4
echo "sanitize: clean"
