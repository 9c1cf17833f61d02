"""`python -m benchmarks.throughput loader`: the training input pipeline (clipms.data.dataset) in
samples/s and CPU cost per sample, what `--ranks` devices need from it; and
`write_synthetic_shards`, the synthetic train shards it (and tests) read when no shards are
given."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from typing import Any

from benchmarks.throughput.common import Subcommand, register


def write_synthetic_shards(out: Any, samples: int, image_size: int, per_shard: int = 256) -> Any:
    """Train shards of the synthetic dataset in the shard format (clipms.data.webds)."""
    import io
    from pathlib import Path

    from clipms.data import webds
    from prep.synthetic import make_image

    def sample_files(index: int) -> webds.SampleFiles:
        record, pixels = make_image(0, index, image_size)
        jpeg = io.BytesIO()
        pixels.convert("RGB").save(jpeg, format="JPEG", quality=95)
        key = f"{index:09d}"
        meta = {"captions": list(record.captions), "url": record.file_name, "key": key,
                "split": "train", "labels": record.scene.labels()}
        return key, {"jpg": jpeg.getvalue(), "txt": record.captions[0].encode(),
                     "json": json.dumps(meta).encode()}

    out = Path(out)
    split = webds.write_split(out, "train", map(sample_files, range(samples)), per_shard)
    webds.write_manifest(out, per_shard, {"train": split})
    return out


def _tree_cpu_s(process: Any) -> float:
    """CPU-seconds of a process and its live children (the loader's decode workers)."""
    total = 0.0
    for proc in [process, *process.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except Exception:  # noqa: BLE001 - a worker may exit while we look
            continue
        total += times.user + times.system
    return total


def add_loader_arguments(parser: argparse.ArgumentParser) -> None:
    from pathlib import Path

    parser.add_argument("--shards", type=Path, default=None,
                        help="shards folder with manifest.json (default: synthetic shards in a "
                             "temporary folder)")
    parser.add_argument("--split", default="train")
    parser.add_argument("--samples", type=int, default=1024, help="synthetic shards: samples")
    parser.add_argument("--source-size", type=int, default=256,
                        help="synthetic shards: JPEG side (download.image_size)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a tokenizer.json (default: the OpenAI vocabulary)")
    parser.add_argument("--context-length", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=64, help="model input side (tiny: 64)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2, help="decode worker processes")
    parser.add_argument("--augment", action="store_true", help="random resized crop")
    parser.add_argument("--warmup", type=int, default=3, help="batches not timed")
    parser.add_argument("--batches", type=int, default=30, help="batches timed")
    parser.add_argument("--ranks", type=int, default=8,
                        help="training processes (devices) on the host to size the loader for")
    parser.add_argument("--device-rate", type=float, default=DEVICE_RATE,
                        help="samples/s one device trains; the default is MindCV's ViT-B/32 on "
                             "one Ascend 910 (docs/ascend.md); measure yours and pass it")


# MindCV's ViT-B/32 (image tower only) on 8 x Ascend 910: 619 ms/step at 256 images per device
# (mindspore-lab/mindcv configs/vit/README.md and vit_b32_224_ascend.yaml at commit 0bc0866).
# A CLIP step adds the text tower, so a CLIP device consumes at most this many samples/s.
DEVICE_RATE = round(256 / 0.619)


# The kernel counts CPU time in clock ticks (10 ms at USER_HZ 100): a run that used less than ten
# ticks has no usable CPU cost per sample, so nothing is sized from it.
MIN_MEASURABLE_CPU_S = 0.1


def loader_needs(result: dict[str, Any], ranks: int, device_rate: float) -> dict[str, Any]:
    """What `ranks` devices training `device_rate` samples/s each need from this loader: decode
    processes per rank and busy cores, from the CPU cost per sample measured here."""
    if result["cpu_ms_per_sample"] <= 0:
        raise ValueError(f"cpu_ms_per_sample must be positive to size a loader, got "
                         f"{result['cpu_ms_per_sample']}")
    per_core = 1000.0 / result["cpu_ms_per_sample"]  # samples/s of one fully busy core
    return {"ranks": ranks, "device_samples_per_s": device_rate,
            "host_samples_per_s": round(ranks * device_rate),
            "samples_per_s_per_core": round(per_core, 1),
            "workers_per_rank": math.ceil(device_rate / per_core),
            "busy_cores": math.ceil(ranks * device_rate / per_core)}


def run_loader(args: argparse.Namespace) -> dict[str, Any]:
    """samples/s of the whole training input pipeline: read, decode, preprocess, tokenize, batch.
    Also the CPU cost per sample, which is robust to a busy machine and is what the loader takes
    away from training on the same cores."""
    import tempfile

    import psutil  # a MindSpore dependency

    from clipms.data.dataset import build_train_dataset, steps_per_epoch
    from clipms.data.loading import LoaderSettings
    from clipms.data.preprocess import PreprocessConfig
    from clipms.text.clip_tokenizer import Tokenizer

    tokenizer = (Tokenizer.load(args.tokenizer) if args.tokenizer
                 else Tokenizer.openai(args.context_length))
    with tempfile.TemporaryDirectory(prefix="clipms-loader-") as tmp:
        shards = args.shards or write_synthetic_shards(tmp, args.samples, args.source_size)
        wanted = args.warmup + args.batches
        epochs = -(-wanted // steps_per_epoch(shards, args.batch_size, split=args.split))
        load_before, started = os.getloadavg()[0], time.perf_counter()
        dataset = build_train_dataset(shards, tokenizer, PreprocessConfig(args.image_size),
                                      args.batch_size,
                                      LoaderSettings(workers=args.workers, augment=args.augment),
                                      epochs=epochs, split=args.split)
        build_s = time.perf_counter() - started
        cpu_before, batch_ms = _tree_cpu_s(psutil.Process()), []
        tick = time.perf_counter()
        batches = dataset.create_tuple_iterator(num_epochs=1, output_numpy=True)
        for _, _batch in zip(range(wanted), batches, strict=False):
            batch_ms.append((time.perf_counter() - tick) * 1000)
            tick = time.perf_counter()
        cpu_s = _tree_cpu_s(psutil.Process()) - cpu_before
    timed = batch_ms[args.warmup:]
    samples_per_s = args.batch_size * len(timed) / (sum(timed) / 1000)
    result = {"bench": "loader", "samples_per_s": round(samples_per_s, 1),
              "samples_per_s_per_worker": round(samples_per_s / max(1, args.workers), 1),
              "median_batch_ms": round(statistics.median(timed), 1), "batches": len(timed),
              "batch_size": args.batch_size, "image_size": args.image_size,
              "workers": args.workers, "augment": args.augment, "tokenizer": tokenizer.kind,
              "context_length": tokenizer.context_length,
              "cpu_ms_per_sample": round(1000 * cpu_s / (len(batch_ms) * args.batch_size), 2),
              "build_s": round(build_s, 2), "first_batch_s": round(batch_ms[0] / 1000, 2),
              "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
    if cpu_s < MIN_MEASURABLE_CPU_S:
        result["needs"] = None
        result["needs_unmeasured"] = (f"the timed batches used {cpu_s:.3f} CPU-s, under the "
                                      f"{MIN_MEASURABLE_CPU_S} s the clock resolves; time more "
                                      "or larger batches")
    else:
        result["needs"] = loader_needs(result, args.ranks, args.device_rate)
    return result


register(Subcommand("loader", "training data pipeline samples/s (decode, preprocess, tokenize, "
                    "batch)", add_loader_arguments, run_loader))
