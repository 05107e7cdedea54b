"""`python -m dsv4 ...`: the same as the `dsv4` command (dsv4/cli/main.py)."""
import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
