"""The `dsv4` command (`python -m dsv4`): `main` dispatches `decode`, `chat`, `serve`, `bench` and
`make-checkpoint`; `options` holds the flags they share, their checks and their words. Argument
parsing and terminal output only, no model logic. Imports from every layer below (the benchmarks,
the server, the runtime, text, weights); nothing imports it.
"""
