"""The bounds on what one client may send: the size of a request body, the size of a request head,
the time a client may take to send a request, the number of open connections; their defaults (the
body's derived from the context capacity) and their checks. Enforced by body.py (the body, while
it is read) and connection.py (the rest, per connection). Needs none of the serve extra: the
command's --help shows these defaults.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import InputError

KIB, MIB = 2 ** 10, 2 ** 20
# The longest token of the DSV4 vocabulary is 128 bytes as JSON text (ASCII-escaped; the mean is
# ~10, English text ~5 a token): so any prompt that fits --max-seq-len tokens fits this many
# bytes a token, as a string or as token ids (<= 8 bytes an id), with the messages' JSON around it.
BODY_BYTES_PER_TOKEN = 128
MIN_BODY_BYTES = MIB                 # room for tools, system prompts and JSON at small contexts
HEADER_BYTES = 16 * KIB              # request line + headers (h11's own default); a key is < 1 KiB
READ_TIMEOUT_S = 30.0                # from the connection (or the previous reply) to the last byte
MAX_CONNECTIONS = 64                 # open at once: the queue, /health and /metrics, keep-alives
_SIZE = re.compile(r"^\s*(\d+)\s*([kmg]?)(?:i?b)?\s*$", re.IGNORECASE)


def default_request_bytes(max_seq_len: int) -> int:
    """The default body cap for a context of max_seq_len tokens: 128 bytes a token, >= 1 MiB."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_seq_len)


def parse_size(text: str, flag: str) -> int:
    """Bytes of "1048576", "512K", "64M", "1G" (binary units; "MiB", "MB" read the same)."""
    m = _SIZE.match(str(text))
    if not m:
        raise InputError(f"{flag} {text}: expected a size in bytes, e.g. 1048576, 512K, 64M or 1G")
    return int(m.group(1)) * {"": 1, "k": KIB, "m": MIB, "g": 2 ** 30}[m.group(2).lower()]


@dataclass(frozen=True)
class Limits:
    """What one client may send (each field is the `dsv4 serve` flag of the same name)."""
    max_request_bytes: int
    max_header_bytes: int = HEADER_BYTES
    read_timeout: float = READ_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS

    def __post_init__(self):
        for name, low in (("max_request_bytes", 1), ("max_header_bytes", KIB),
                          ("max_connections", 2)):
            v = getattr(self, name)
            if v < low:
                raise InputError(f"--{name.replace('_', '-')} {v}: must be >= {low}")
        if not self.read_timeout > 0:
            raise InputError(f"--read-timeout {self.read_timeout}: must be > 0 seconds (the time "
                             f"a client may take to send a request)")

    @classmethod
    def for_context(cls, max_seq_len: int, **given) -> "Limits":
        """The defaults for a context of max_seq_len tokens; `given` (not None) overrides them."""
        return cls(**{"max_request_bytes": default_request_bytes(max_seq_len),
                      **{k: v for k, v in given.items() if v is not None}})
