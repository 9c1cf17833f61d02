"""What each `msrun` worker runs: `worker.py JOB_JSON` (the two-line script `clipms.parallel.launch`
writes calls `worker_main`). Kept apart from the launcher, so no module both launches and is
launched."""

# not unit-tested: msrun starts it as a script; tests/clipms/parallel/test_launch.py runs it
# on two ranks.

from __future__ import annotations

import logging
import sys

from clipms.train.job import TrainJob, run
from clipms.utils.jsonio import read_json


def worker_main(argv: list[str] | None = None) -> None:
    """Entry point of one msrun worker: `worker.py JOB_JSON`."""
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True,
                        format="%(asctime)s %(name)s: %(message)s")
    job = TrainJob.from_dict(read_json(argv[0]))
    run(job, distributed=True)
