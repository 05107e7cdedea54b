"""Programs an engine author can copy from; run them from the repository root:
`python -m examples.NAME`."""
