"""Benchmarks, apart from the runtime (nothing in dsv4 imports them): `decode` (`dsv4 bench`,
scripts/bench.py) with its `prefill` and `speculative` parts, `memory` (bytes per token, the
memory check), `common` (timing and kernel-count helpers), the kernel microbenchmarks `kernels`
(scripts/bench_kernels.py) and `prefill_kernels` (`python -m dsv4.bench.prefill_kernels`), and
`serve` (scripts/bench_serve.py). Imports point one way: decode -> prefill / speculative ->
common / memory -> the runtime.
"""

MIN_STEPS = 50    # PERFORMANCE.md: a figure here is the median of >= 50 steps
