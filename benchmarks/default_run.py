"""The default run as a user meets it: `make run` in a fresh clone, timed, and what it learned.

    python benchmarks/default_run.py

Clones this repository's HEAD into a temporary folder, then runs there what `make run` runs after
the environment exists (`dvc repro`, every stage from an empty cache; the environment is this
Python's, so its creation is not timed), and takes the wall and CPU time of the whole pipeline
and the peak memory of its largest process. Records them with the run's `metrics/train.json` and
the headline figures of its `metrics/eval.json` in benchmarks/results/default_run.json
(`--results`). About 12 minutes on an idle 2-core machine: measure on an idle one, the figure is
the time a user waits. `--second-seed` then runs `dvc exp run -n seed1 -S train.seed=1` in the
same clone and records its figures too (another ~13 minutes): one seed is one draw.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import record  # benchmarks/record.py, beside this script

# The figures a reader of the default run looks at first (metrics/eval.json has ~60 keys).
HEADLINE = ("num_images", "num_captions", "i2t_R@1", "i2t_R@5", "i2t_R@10", "t2i_R@1", "t2i_R@5",
            "t2i_R@10", "mAP@10", "zeroshot_classes", "zeroshot_top1", "zeroshot_top5",
            "zeroshot_mean_per_class_recall")


def timed(cmd: list[str], clone: Path) -> dict[str, float]:
    """`cmd` in `clone`: wall seconds, CPU seconds of its process tree, and the peak RSS of its
    largest process (training)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(clone), "DVC_NO_ANALYTICS": "1", "GLOG_v": "3"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(cmd, cwd=clone, env=env, check=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"wall_s": round(wall, 1),
            "cpu_user_s": round(after.ru_utime - before.ru_utime, 1),
            "cpu_sys_s": round(after.ru_stime - before.ru_stime, 1),
            "largest_process_rss_mb": round(after.ru_maxrss / 1024)}


def figures(clone: Path) -> dict[str, dict]:
    """The run's training metrics and the headline of its evaluation."""
    train = json.loads((clone / "metrics" / "train.json").read_text())
    evaluation = json.loads((clone / "metrics" / "eval.json").read_text())
    return {"train": train, "eval": {k: evaluation[k] for k in HEADLINE}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--second-seed", action="store_true",
                   help="then `dvc exp run -n seed1 -S train.seed=1` in the same clone")
    p.add_argument("--results", type=Path,
                   help="result file (default: benchmarks/results/default_run.json)")
    args = p.parse_args()
    recording = record.start("default_run")
    with tempfile.TemporaryDirectory(prefix="clipms-default-run-") as tmp:
        clone = Path(tmp) / "clipms"
        subprocess.run(["git", "clone", "--quiet", str(record.ROOT), str(clone)], check=True)
        result = {"seed0": {**timed(["dvc", "repro"], clone), **figures(clone)}}
        if args.second_seed:
            result["seed1"] = {**timed(["dvc", "exp", "run", "-n", "seed1", "-S", "train.seed=1"],
                                       clone), **figures(clone)}
    print(json.dumps(result))
    recording.write(result, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
