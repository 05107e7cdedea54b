"""The fused-kernel implementations of the model's sublayers: what dsv4.backend.bind binds in
place of a sublayer's torch reference where the device's Backend decided so. Each function takes
the sublayer (its weights and decode state) and the device's Ops: `linear` (GEMVs of decode rows,
the prefill GEMM of a chunk), `head` (hc_head + norm, the head GEMV), `compressor`, `indexer`,
`attention` (decode rows with the compressors and the indexer as parallel branches; the chunk's
rows), `moe` (routing, routed FP4 experts and the shared expert of decode rows; the grouped GEMMs
of a chunk), `block` (the fused mHC around attention and the MoE), `mtp` (the MTP block's input
of decode rows).
"""
