"""The worker process behind ``subquad bench`` on CPU: one JSON job per line on stdin, one JSON
result per line on stdout (see ``measure.Worker``); a job with ``"kind": "model"`` is a whole
model's memory step (``model_measure.run_memory_job``). Its parent starts it with
``MALLOC_MMAP_THRESHOLD_=131072`` so that RSS measures each call honestly."""

import json
import os
import sys

if __name__ == "__main__":
    # Only results go to the real stdout; anything else printed (by torch as it loads, by a
    # kernel) goes to stderr, which the parent keeps for the message if this process dies.
    _PROTOCOL = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

from .measure import run_job  # after the redirection: importing torch may print
from .model_measure import run_memory_job


def main() -> int:
    protocol = _PROTOCOL
    for line in sys.stdin:
        if line.strip():
            job = json.loads(line)
            answer = run_memory_job(job) if job.get("kind") == "model" else run_job(job)
            protocol.write(json.dumps(answer) + "\n")
            protocol.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
