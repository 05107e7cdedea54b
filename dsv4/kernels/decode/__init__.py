"""The kernels of the decode step (one token, or the speculative verify rows): dsv4/kernels/__init__.py."""
