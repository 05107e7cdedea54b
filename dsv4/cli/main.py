"""The `dsv4` command (`python -m dsv4`): `dsv4 decode | chat | serve | bench | make-checkpoint`,
each a subcommand with its own flags (`dsv4 SUBCOMMAND --help`); docs/CLI.md.
"""
from __future__ import annotations

import importlib
import sys

# subcommand -> (module, what it does); each module has main(argv) -> int
SUBCOMMANDS = {
    "decode": ("dsv4.cli.decode", "decode one prompt: streamed text, a summary or one JSON object"),
    "chat": ("dsv4.cli.chat", "multi-turn chat in the terminal (or through a pipe)"),
    "serve": ("dsv4.cli.serve", "the OpenAI-compatible HTTP server"),
    "bench": ("dsv4.cli.bench", "decode benchmark on device-generated weights (BENCHMARKS.md)"),
    "make-checkpoint": ("dsv4.cli.main", "write a random-weight checkpoint in the released format"),
}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = ["usage: dsv4 SUBCOMMAND [flags]   (dsv4 SUBCOMMAND --help for its flags)", "",
             "Batch-1 DeepSeek-V4 decoding (CUDA graphs or eager). Subcommands:"]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in SUBCOMMANDS.items()]
    lines += ["", "Docs: README.md, docs/CLI.md, docs/REAL_MODEL.md, docs/EMBEDDING.md."]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"error: unknown subcommand {name!r}; choose one of {', '.join(SUBCOMMANDS)} "
              f"(dsv4 --help)", file=sys.stderr)
        return 2
    if name == "make-checkpoint":
        return make_checkpoint(rest)
    module = SUBCOMMANDS[name][0]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:           # the module exists but one of its imports is missing
            raise
        print(f"error: dsv4 {name} is not available in this installation ({module} is missing)",
              file=sys.stderr)
        return 2
    return mod.main(rest)


def make_checkpoint(argv=None) -> int:
    """`dsv4 make-checkpoint` / scripts/make_checkpoint.py: a random checkpoint of a preset or a
    config, exactly the release's tensor names, shapes and dtypes (dsv4.weights.synthetic)."""
    from pathlib import Path

    from ..errors import exit_code
    from ..weights.config import ModelConfig
    from ..weights.presets import PRESETS, get_preset, truncate_layers
    from .options import Parser

    p = Parser(prog="dsv4 make-checkpoint",
               description="Write a random-weight DeepSeek-V4 checkpoint in the released format "
                           "(config.json + safetensors shards + index).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help=f"a named config: {', '.join(PRESETS)}")
    src.add_argument("--config", help="a config.json (released or inference style) or its folder")
    p.add_argument("--out", required=True, help="output folder (earlier checkpoint files there "
                   "are replaced)")
    p.add_argument("--layers", type=int, help="keep only the first N main layers")
    # dsv4.weights.synthetic.WEIGHT_MODES (spelled out: that module imports torch, and --help
    # must not; a test keeps the two equal)
    p.add_argument("--weights", default="fp8", choices=("fp8", "bf16"),
                   help="fp8: FP8 linears + FP4 experts (the release format); bf16: plain BF16")
    p.add_argument("--seed", type=int, default=0, help="weight seed (values depend only on it "
                   "and the tensor name)")
    p.add_argument("--shards", type=int, default=2, help="number of shard files; 0 writes a "
                   "single model.safetensors without index")
    p.add_argument("--device", default="cpu", help="draw and quantize the weights here: cpu, or "
                   "cuda[:N] (minutes become seconds for Flash-sized layers; other values than "
                   "the CPU's for the same seed)")

    def body() -> int:
        a = p.parse_args(argv)
        from ..weights.synthetic import write_checkpoint
        if a.preset is not None:
            cfg = get_preset(a.preset)
        else:
            cfg = ModelConfig.from_json(Path(a.config))
        if a.layers is not None:
            cfg = truncate_layers(cfg, a.layers)
        if a.device != "cpu":
            from ..runtime.config import resolve_devices
            resolve_devices(a.device)           # a CUDA device that is there, else exit 2
        out = write_checkpoint(cfg, a.out, weights=a.weights, seed=a.seed, shards=a.shards,
                               device=a.device)
        size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
        print(f"{out} ({size / 2**20:.1f} MiB)")
        return 0
    return exit_code(body)
