"""How long the training thread is blocked by a checkpoint: a synchronous `checkpoint.save`
against `CheckpointWriter.submit` (host copy only; the write runs on a background thread).

    python benchmarks/bench_checkpoint.py --preset tiny --repeats 3

The state is the preset's parameter count times three (weights and the two AdamW moments, fp32,
as MindSpore Parameters), as the trainer saves it. Sync and async are alternated in one run;
prints one JSON line with the median seconds of each and the file size, and records it in
benchmarks/results/checkpoint.json (`--results`). The checkpoints are written to a temporary
folder (`--out` to keep them in one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import record  # benchmarks/record.py, beside this script

import clipms  # noqa: F401  (MindSpore's environment before it is imported)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--out", type=Path, help="where to write the checkpoints (default: a "
                        "temporary folder, removed afterwards)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--results", type=Path,
                        help="result file (default: benchmarks/results/checkpoint.json)")
    args = parser.parse_args()
    recording = record.start("checkpoint")
    with tempfile.TemporaryDirectory(prefix="clipms-ckpt-bench-") as tmp:
        result = measure(args, args.out or Path(tmp))
    print(json.dumps(result))
    recording.write(result, args.results)


def measure(args: argparse.Namespace, out: Path) -> dict:
    import mindspore as ms
    import numpy as np

    from clipms.model.architecture import get_preset
    from clipms.train import checkpoint
    from ops.preflight import parameter_count

    count = parameter_count(get_preset(args.preset))
    rng = np.random.default_rng(0)
    tensors = {f"{kind}.{i}": ms.Parameter(ms.Tensor(rng.standard_normal(count // 24,
                                                                        dtype=np.float32)))
               for kind in ("w", "adam_m", "adam_v") for i in range(8)}  # 3 x count floats,
    # as MindSpore Parameters like the trainer's state
    sync_s, blocked_s, done_s = [], [], []
    writer = checkpoint.CheckpointWriter(out / "async", keep=2)
    for step in range(1, args.repeats + 1):
        started = time.perf_counter()
        checkpoint.save(out / "sync", step, tensors, {"step": step}, keep=2)
        sync_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        writer.submit(step, tensors, {"step": step})
        blocked_s.append(time.perf_counter() - started)
        writer.wait()
        done_s.append(time.perf_counter() - started)
    size = checkpoint.list_checkpoints(out / "sync")[-1].stat().st_size
    return {"bench": "checkpoint", "preset": args.preset, "parameters": count,
            "file_mb": round(size / 2**20, 1), "repeats": args.repeats,
            "sync_save_s": round(statistics.median(sync_s), 3),
            "async_blocked_s": round(statistics.median(blocked_s), 3),
            "async_written_s": round(statistics.median(done_s), 3)}


if __name__ == "__main__":
    main()
