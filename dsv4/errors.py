"""Typed errors for user-facing problems (bad config, bad checkpoint, bad input).

Every message names the problem and, where there is one, the fix. Scripts turn
`UserInputError` subclasses into one stderr line and exit status 2; anything else
is a runtime failure (exit 1).
"""
from __future__ import annotations


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
    """A requested device or mode that is not available (e.g. --mode graph without CUDA)."""


def exit_code(fn) -> int:
    """Run a CLI body: 0 (or its return value) on success, 2 with one stderr line for a
    UserInputError, 130 on Ctrl-C, 1 with the cause for anything else (DSV4_TRACEBACK=1 re-raises)."""
    import os
    import sys
    try:
        return fn() or 0
    except UserInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if os.environ.get("DSV4_TRACEBACK"):
            raise
        print(f"runtime error: {type(e).__name__}: {e} (set DSV4_TRACEBACK=1 for the traceback)",
              file=sys.stderr)
        return 1
