"""The kernels of a prefill chunk's rows: dsv4/kernels/__init__.py."""
