"""The released checkpoint: `config` (ModelConfig from config.json), `presets`, `dspark` (the
DSpark release's draft module), `formats` (FP8 e4m3 / FP4 e2m1 with e8m0 scales), `checkpoint`
(open, validate against the tensor table, load), `values` (the cheap checks of a tensor's values
as it loads), `hub` (a Hugging Face repo id to a local snapshot, through huggingface_hub),
`synthetic` (random checkpoints in the release format), `device_weights` (random weights made on
the device, for benchmarks). Imports errors only.
"""
