"""Test launcher: scripts/serve.py whose worker, while the file given as `--test-gate PATH` exists,
holds the job it has taken before decoding it. A test that needs requests to stay queued (a full
queue) creates the file, sends them, checks, and removes it: on any device, however fast a step
is, the queue is full when the test looks (without the gate a GPU finishes them first)."""
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    argv = sys.argv[1:]
    i = argv.index("--test-gate")
    gate = Path(argv[i + 1])
    del argv[i:i + 2]
    from dsv4.server import engine
    run = engine.Engine._run

    def gated_run(self, job):
        while gate.exists() and not job.cancel.is_set():
            time.sleep(0.01)
        return run(self, job)

    engine.Engine._run = gated_run
    from dsv4.cli.serve import main
    sys.exit(main(argv))
