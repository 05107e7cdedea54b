"""What `dsv4 decode`, `chat` and `serve` share: the parser style (defaults in --help, one-line
errors), the model / sampling / runtime flags and their checks (output paths included), the
checkpoint of --ckpt (a folder or a Hugging Face repo id) or --demo, and loading it for a command
(tokenizer, notice, model, session). Imports nothing heavy at module level: `dsv4 X --help`
never imports torch (tests/test_cli_startup.py).
"""
from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path

from ..errors import InputError, MissingFileError
from ..runtime.defaults import PREFILL_CHUNK
from ..runtime.speculative.policy import DEFAULT_MIN_ACCEPTANCE, check_min_acceptance


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" after each flag's help, except where there is nothing to show (no
    default, an off switch) or the help text states the default itself."""

    def _get_help_string(self, action):
        text = action.help or ""
        d = action.default
        if (d is None or d is False or d == argparse.SUPPRESS or "default" in text
                or not action.option_strings):
            return text
        return text + " (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse with the house conventions: defaults in --help, a usage error is one line."""

    def __init__(self, *a, **kw):
        kw.setdefault("formatter_class", HelpFormatter)
        super().__init__(*a, **kw)

    def error(self, message):          # one line, exit 2
        raise InputError(f"{message} (see --help)")


# ---- flags ---------------------------------------------------------------------------------

def add_model_args(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("model")
    src.add_argument("--ckpt", help="checkpoint folder in the released DSV4 format, or a Hugging "
                     "Face repo id (deepseek-ai/DeepSeek-V4-Flash: the local Hugging Face cache "
                     "first, downloaded into it otherwise; HF_HUB_OFFLINE=1: the cache only)")
    src.add_argument("--demo", action="store_true",
                     help="build (once, cached) and run a tiny random-weight model (the default "
                          "when no --ckpt is given)")


def add_sampling_args(p, max_new_tokens: int | None = None,
                      title: str = "generation") -> None:
    """--max-new-tokens (when a default is given: the server takes it per request), --temperature,
    --top-p, --top-k, --seed; p: a parser (the flags go in a group named `title`) or a group."""
    g = p.add_argument_group(title) if isinstance(p, argparse.ArgumentParser) else p
    if max_new_tokens is not None:
        g.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                       help="most tokens to generate (stops earlier at EOS)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1 = off)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (0 = off)")
    g.add_argument("--seed", type=int, default=None,
                   help="sampling seed (drawn at random and printed when sampling without one; "
                        "unused by greedy decoding)")


def add_runtime_args(p: argparse.ArgumentParser, max_seq_len: int | None = None,
                     max_seq_len_help: str = "cache capacity in tokens (default: the prompt + "
                                             "--max-new-tokens, rounded up to 256)",
                     parallel: bool = False) -> None:
    """The runtime flags; parallel: the command takes --parallel tp (dsv4 decode)."""
    r = p.add_argument_group("runtime")
    r.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:0,cuda:1 (pipeline)")
    if parallel:
        r.add_argument("--parallel", default="pipeline", choices=("pipeline", "tp"),
                       help="several devices: pipeline (the layers split over them, one busy at "
                            "a time) or tp (every layer split over them, one process a device: "
                            "--device cuda:0,cuda:1 with NCCL, or cpu,cpu with gloo)")
    r.add_argument("--mode", default="auto", choices=("auto", "graph", "eager"),
                   help="CUDA graphs or eager; auto = graph when CUDA is available")
    r.add_argument("--granularity", default="auto",
                   choices=("auto", "staged", "segment", "device"),
                   help="graph mode: each device's run of layers in graphs of 2, 4, 8, ... layers "
                        "(staged: the device starts while the host launches the rest), one graph "
                        "per layer (segment: per-layer NVTX ranges and profile summary), or one "
                        "per device run; auto = segment with --profile, else staged")
    r.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="activation dtype (float32: the high-precision reference mode)")
    r.add_argument("--max-seq-len", type=int, default=max_seq_len, help=max_seq_len_help)
    r.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK, metavar="N",
                   help="prefill the prompt N tokens at a time (same result; activation memory "
                        "grows with N)")
    r.add_argument("--prefill-graphs", type=int, default=0, metavar="N",
                   help="graph mode: capture prefill chunks of 1, 2, 4, ..., N tokens at startup "
                        "(N a power of two; 0 = off) and replay them unless the eager chunk "
                        "measured more than 10%% faster (N-token pieces, then the rest): a "
                        "faster first token, paid for by the capture (worth it when one process "
                        "serves several prompts)")
    r.add_argument("--speculative", type=int, default=0, metavar="K",
                   help="self-speculative decoding with the checkpoint's MTP block, K drafted "
                        "tokens per step (0 = off; K = 1 is implemented)")
    r.add_argument("--speculative-min-acceptance", type=float, default=DEFAULT_MIN_ACCEPTANCE,
                   metavar="A",
                   help="with --speculative: while fewer than this share of the drafts are "
                        "accepted, decode plain steps (the MTP block following) and try drafting "
                        "again later (about where drafting starts to pay on Flash; 0 = always "
                        "draft)")


# ---- checks --------------------------------------------------------------------------------

def check_runtime_args(args) -> tuple[list[str], str]:
    """Every runtime-flag check that needs no checkpoint (and --ckpt / --demo, --max-new-tokens
    where the parser has them); -> (devices, resolved mode)."""
    from ..runtime.config import check_prefill_graphs, resolve_devices, resolve_mode
    if getattr(args, "ckpt", None) and getattr(args, "demo", False):
        raise InputError("give either --ckpt DIR or --demo, not both")
    n = getattr(args, "max_new_tokens", None)     # absent: taken per request (the server)
    if n is not None and n < 1:
        raise InputError(f"--max-new-tokens {n}: must be >= 1")
    if args.prefill_chunk < 1:
        raise InputError(f"--prefill-chunk {args.prefill_chunk}: must be >= 1 (tokens per "
                         f"prefill pass; default {PREFILL_CHUNK})")
    check_prefill_graphs(args.prefill_graphs)        # its value, before any device is touched
    if args.speculative not in (0, 1):
        raise InputError(f"--speculative {args.speculative}: allowed 0 (off) or 1 (one drafted "
                         f"token per step; more is not implemented)")
    check_min_acceptance(args.speculative_min_acceptance)
    if getattr(args, "parallel", "pipeline") == "tp":
        from ..runtime.config import resolve_tp_devices
        devices = resolve_tp_devices(args.device)
    else:
        devices = resolve_devices(args.device)
    mode = resolve_mode(args.mode, devices)
    check_prefill_graphs(args.prefill_graphs, mode, bool(args.speculative))
    if getattr(args, "granularity", None) == "auto":  # a profile's per-layer ranges need segment
        args.granularity = "segment" if getattr(args, "profile", "none") != "none" else "staged"
    return devices, mode


def sampling_params(args):
    """SamplingParams of the flags, and the seed to report (None: greedy without --seed)."""
    from ..runtime.sampling import SamplingParams
    seed = args.seed
    if seed is None and args.temperature != 0:
        seed = secrets.randbelow(2 ** 31)
    return SamplingParams(args.temperature, args.top_p, args.top_k, seed or 0), seed


def checkpoint_dir(args) -> Path:
    """The checkpoint folder of --ckpt / --demo (the demo when neither is given): --ckpt is a
    folder, or else a Hugging Face repo id (owner/name) resolved through huggingface_hub (the
    cache first; dsv4.weights.hub)."""
    demo = args.demo or not args.ckpt
    if demo and not args.demo:
        print("[dsv4] no --ckpt given: running the demo (tiny model, random weights)", file=sys.stderr)
    ckpt = Path(demo_checkpoint() if demo else args.ckpt)
    if ckpt.exists() and not ckpt.is_dir():
        raise MissingFileError(f"--ckpt {ckpt} is not a directory (it is a file); pass the "
                               f"checkpoint folder that holds config.json and the shards")
    if not ckpt.is_dir():
        from ..weights.hub import looks_like_repo_id, resolve_checkpoint
        if not demo and looks_like_repo_id(args.ckpt):
            return resolve_checkpoint(args.ckpt)
        raise MissingFileError(f"checkpoint directory not found: {ckpt} (--ckpt takes a folder "
                               f"or a Hugging Face repo id such as deepseek-ai/DeepSeek-V4-Flash)")
    return ckpt


def model_name(args, ckpt: Path) -> str:
    """What the checkpoint is called in messages and by the server: the repo id that --ckpt
    gave (its snapshot folder is named by a commit hash), else the folder's name."""
    given = getattr(args, "ckpt", None)
    return given if given and not args.demo and not Path(given).exists() else ckpt.name


def check_output_path(path: str | None, flag: str, suffix: str = "") -> Path | None:
    """An output file's path, checked before anything loads: its folder exists and takes a new
    file, and the path is not a folder; InputError naming `flag` otherwise. suffix: what the
    writer appends when the path lacks it (numpy's .npy)."""
    if path is None:
        return None
    out = Path(path).expanduser()
    if out.is_dir() or not out.name:
        raise InputError(f"{flag} {path}: is a directory; give a file path such as "
                         f"{Path(path) / ('out' + suffix)}")
    if suffix and out.suffix != suffix:
        out = out.with_name(out.name + suffix)
    folder = out.parent
    if out.is_dir():
        raise InputError(f"{flag} {path}: {out} is a directory; give another file name")
    if not folder.is_dir():
        raise InputError(f"{flag} {path}: the folder {folder} does not exist; create it first "
                         f"or give a path in an existing folder")
    try:                   # the one test that holds for root and read-only mounts alike
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".dsv4-write-check-"):
            pass
        if out.exists() and not os.access(out, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as e:
        raise InputError(f"{flag} {path}: cannot write there ({e.strerror or e}); give a writable "
                         f"path") from None
    return out


def check_output_dir(folder: Path, flag: str) -> None:
    """A folder a command will write into (made now if missing), checked before anything loads;
    InputError naming `flag` otherwise."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".dsv4-write-check-"):
            pass
    except OSError as e:
        raise InputError(f"{flag}: cannot write into {folder} ({e.strerror or e}); run from a "
                         f"checkout you can write to") from None


def check_checkpoint_args(args, cfg) -> None:
    """Flag checks that need the checkpoint's config (before any weight is read)."""
    if args.speculative and cfg.dspark is not None:
        raise InputError(f"--speculative {args.speculative}: this is a DSpark checkpoint "
                         f"(dspark_block_size = {cfg.dspark.block_size}) and DSpark drafting is "
                         f"not supported yet; use --speculative 0 (plain decoding of its backbone)")
    if args.speculative and cfg.n_mtp_layers < 1:
        raise InputError(f"--speculative {args.speculative}: the checkpoint has no MTP block "
                         f"(num_nextn_predict_layers = 0); use --speculative 0")


def check_tp_split(args, cfg, devices: list[str]) -> None:
    """--parallel tp: the checkpoint's shapes split over the devices (else InputError)."""
    if getattr(args, "parallel", "pipeline") != "tp":
        return
    from ..model.sharding import split_problems
    problems = split_problems(cfg, len(devices))
    if problems:
        raise InputError(f"--parallel tp --device {','.join(devices)}: this checkpoint cannot be "
                         f"split over {len(devices)} ranks: {'; '.join(problems)}; use fewer "
                         f"devices or --parallel pipeline")


def demo_checkpoint() -> Path:
    """The cached tiny random-weight checkpoint (built once under the user's cache directory)."""
    from ..weights.presets import TINY
    from ..weights.synthetic import write_checkpoint
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dsv4"
    path = root / "demo-tiny-v1"
    if (path / "model.safetensors.index.json").exists():
        return path
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".demo-tmp-{os.getpid()}"
    print(f"[dsv4] building the demo checkpoint (random weights) in {path} ...", file=sys.stderr)
    write_checkpoint(TINY, tmp, weights="fp8", seed=0, shards=2)
    try:
        tmp.rename(path)
    except OSError:                    # another process won the race
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return path


# ---- loading -------------------------------------------------------------------------------

def load_session(args, ckpt: Path, cap: int, devices: list[str], mode: str, sampling):
    """Load the checkpoint for a command and build its Session; prints the checkpoint's notice
    (a DSpark draft module left out) on stderr. -> (session, load seconds)."""
    from ..runtime.config import DTYPES, RuntimeConfig
    from ..runtime.session import Session, load_model
    rt = RuntimeConfig(max_seq_len=cap, dtype=DTYPES[args.dtype], devices=tuple(devices),
                       prefill_chunk=args.prefill_chunk, mtp=bool(args.speculative),
                       prefill_graphs=args.prefill_graphs if mode == "graph" else 0)
    t0 = time.perf_counter()
    model, ck = load_model(ckpt, rt)
    ck.close()
    if ck.notice:
        print(f"[dsv4] notice: {ck.notice}", file=sys.stderr)
    load_s = time.perf_counter() - t0
    if args.speculative and devices[0].startswith("cuda"):
        print("[dsv4] note: a --speculative step costs ~1.7x a plain one on Flash (mostly the "
              "verified rows' distinct experts), so drafting pays only when more than ~65-70% "
              "of the drafts are accepted; below --speculative-min-acceptance "
              f"{args.speculative_min_acceptance} the session decodes plain steps and tries "
              "drafting again later", file=sys.stderr)
    session = Session(model, sampling, mode=mode, granularity=args.granularity,
                      speculative=args.speculative,
                      spec_min_acceptance=args.speculative_min_acceptance)
    return session, load_s


def load_tp_session(args, ckpt: Path, cap: int, devices: list[str], mode: str, sampling):
    """--parallel tp for an interactive command: this process is rank 0 (it keeps the terminal),
    the other ranks follow its session (dsv4.runtime.tp.open_session). -> (session, seconds)."""
    from ..runtime.config import DTYPES, RuntimeConfig
    from ..runtime.tp import open_session
    rt = RuntimeConfig(max_seq_len=cap, dtype=DTYPES[args.dtype], devices=(devices[0],),
                       prefill_chunk=args.prefill_chunk, mtp=bool(args.speculative),
                       prefill_graphs=args.prefill_graphs if mode == "graph" else 0)
    return open_session(devices, ckpt, rt, dict(
        params=sampling, mode=mode, granularity=args.granularity, speculative=args.speculative,
        spec_min_acceptance=args.speculative_min_acceptance))
