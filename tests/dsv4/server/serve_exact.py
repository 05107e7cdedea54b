"""Test launcher: scripts/serve.py with the KV fake-quant off, so that a prefill in other pieces
(prefix reuse) differs from a full one by float32 noise only (tests/conftest.py no_fake_quant)."""
import sys

from helpers import disable_fake_quant

if __name__ == "__main__":
    disable_fake_quant()
    from dsv4.cli.serve import main
    sys.exit(main(sys.argv[1:]))
