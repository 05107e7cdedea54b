"""Typed errors for user-facing problems (bad config, bad checkpoint, bad input).

Every message names the problem and, where there is one, the fix. Scripts turn
`UserInputError` subclasses into one stderr line and exit status 2; anything else
is a runtime failure (exit 1).
"""
from __future__ import annotations

import re


class UserInputError(Exception):
    """Base for problems the user can fix (exit status 2 in the CLI)."""


class ConfigError(UserInputError, ValueError):
    """An invalid or unreadable model config (names key, value and what is allowed)."""


class CheckpointError(UserInputError):
    """A checkpoint directory that is missing, incomplete, corrupt or does not match its config."""


class MissingFileError(CheckpointError, FileNotFoundError):
    """A directory, config, index or shard that does not exist."""


class CorruptFileError(CheckpointError):
    """A safetensors file that is truncated or unreadable."""


class TensorMismatchError(CheckpointError):
    """Tensors missing, unexpected, or with the wrong shape/dtype (lists up to 10)."""


class InputError(UserInputError, ValueError):
    """Bad prompt / token ids / generation arguments."""


class CapacityError(InputError):
    """prompt + max_new_tokens does not fit the cache capacity (raised before allocation)."""


class DeviceError(UserInputError, RuntimeError):
    """A requested device or mode that is not available (e.g. mode='graph' without CUDA, a CUDA
    device on a CPU-only torch)."""


class ParallelError(RuntimeError):
    """A tensor-parallel run that cannot go on: a rank that did not join, died, raised or stalled
    past the timeout, or a collective that failed (dsv4.parallel). Names the rank and the cause;
    the run ends (every rank stops), it never hangs."""


# API parameter -> CLI flag. The library's errors name what an embedder passes
# (RuntimeConfig.max_seq_len, max_new_tokens, mode='eager'); the CLI shows the flag instead.
API_FLAGS = {"max_seq_len": "--max-seq-len", "max_new_tokens": "--max-new-tokens",
             "force_ids": "--force-ids", "prefill_chunk": "--prefill-chunk",
             "prefill_graphs": "--prefill-graphs", "spec_min_acceptance":
             "--speculative-min-acceptance", "speculative": "--speculative", "mode": "--mode",
             "temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k",
             "seed": "--seed"}
BARE_OK = ("max_seq_len", "max_new_tokens", "force_ids", "prefill_chunk", "prefill_graphs",
           "spec_min_acceptance", "top_p", "top_k")   # the others only as name=value
_API_RE = re.compile(r"\b(?:RuntimeConfig\.|Session\.)?(" + "|".join(API_FLAGS) +
                     r")\b(?:\s?=\s?'?([\w.\-]+)'?)?")


def in_cli_words(message: str) -> str:
    """`message` with API parameters written as the CLI's flags: 'RuntimeConfig.max_seq_len' ->
    '--max-seq-len', "mode='eager'" -> '--mode eager', 'max_new_tokens = 0' -> '--max-new-tokens 0'."""
    def sub(m: re.Match) -> str:
        name, value = m.group(1), m.group(2)
        if value is None:
            return API_FLAGS[name] if name in BARE_OK else m.group(0)
        return f"{API_FLAGS[name]} {value}"
    return _API_RE.sub(sub, message)


def exit_code(fn) -> int:
    """Run a CLI body: 0 (or its return value) on success, 2 with one stderr line for a
    UserInputError, 130 on Ctrl-C, 1 with the cause for anything else (DSV4_TRACEBACK=1 re-raises).
    Messages name CLI flags (in_cli_words)."""
    import os
    import sys
    try:
        return fn() or 0
    except UserInputError as e:
        print(f"error: {in_cli_words(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if os.environ.get("DSV4_TRACEBACK"):
            raise
        print(f"runtime error: {type(e).__name__}: {in_cli_words(str(e))} (set DSV4_TRACEBACK=1 "
              f"for the traceback)", file=sys.stderr)
        return 1
