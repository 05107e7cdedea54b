"""The plain-torch numerics the model and the kernels' references share: `mhc` (hyper-connection
mixes, Sinkhorn, RMSNorm), `rope` (YaRN RoPE), `sparse` (sparse attention with sink, index scores,
top-k), `quant` (activation quantization, FP8 / FP4 fake-quant, Hadamard). Imports weights
(config, formats) only.
"""
