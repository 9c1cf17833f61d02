"""`clipms-bench <subcommand>`: throughput benchmarks; each run prints one JSON line.

Subcommands live in one registry, `SUBCOMMANDS`. To add one, write `add_<name>_arguments(parser)`
and `run_<name>(args) -> dict`, then `register(Subcommand("<name>", "<help>", add, run))`.
Shared pieces: `add_common_arguments` (--mode/--warmup/--steps/--threads/--kernel-fusion),
`setup_mindspore` (mode + threads + fusion) and `time_steps` (warm-up, then per-step wall
times in ms).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], dict[str, Any]]


SUBCOMMANDS: dict[str, Subcommand] = {}


def register(command: Subcommand) -> Subcommand:
    SUBCOMMANDS[command.name] = command
    return command


# ---- shared helpers -------------------------------------------------------------------------


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", choices=("graph", "pynative"), default="graph",
                        help="MindSpore execution mode (graph is faster on CPU)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (graph compile)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps; the median is kept")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="MindSpore runtime threads (default: all cores)")
    parser.add_argument("--kernel-fusion", choices=("on", "off"), default="on",
                        help="graph-kernel fusion on CPU (clipms.runtime; default on)")
    parser.add_argument("--device", choices=("CPU", "GPU", "Ascend"), default="CPU",
                        help="device target (clipms.runtime.configure)")


def runtime_config(args: argparse.Namespace):  # noqa: ANN201 - clipms.runtime.RuntimeConfig
    from clipms.runtime import RuntimeConfig

    return RuntimeConfig(device_target=args.device, mode=args.mode,
                         kernel_fusion=args.kernel_fusion == "on")


def setup_mindspore(args: argparse.Namespace) -> None:
    from clipms.runtime import configure

    settings = configure(runtime_config(args))  # before MindSpore is imported
    import mindspore as ms

    ms.set_context(runtime_num_threads=args.threads)
    ms.set_seed(0)
    args.kernel_fusion_active = settings.kernel_fusion


def time_steps(step: Callable[[], Any], warmup: int, steps: int,
               cpu_ms: list[float] | None = None) -> list[float]:
    """Run `step` warmup times untimed, then `steps` times; wall time of each in ms.
    `step` must block until its result exists (e.g. end with .asnumpy()). If `cpu_ms` is a list,
    the process CPU time (all threads) per timed step is appended to it: less sensitive than wall
    time to other processes on a shared machine."""
    for _ in range(warmup):
        step()
    times = []
    cpu_start = time.process_time()
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1000)
    if cpu_ms is not None:
        cpu_ms.append((time.process_time() - cpu_start) * 1000 / max(steps, 1))
    return times


def random_tokens(n: int, context_length: int, vocab_size: int, seed: int = 0) -> np.ndarray:
    """Caption-like tokens: SOT, 5-20 words, EOT (the highest id), zero padding."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros((n, context_length), np.int32)
    for row in range(n):
        words = int(rng.integers(5, min(20, context_length - 2) + 1))
        tokens[row, 0] = vocab_size - 2
        tokens[row, 1 : words + 1] = rng.integers(1, vocab_size - 2, words)
        tokens[row, words + 1] = vocab_size - 1
    return tokens


def random_pixels(n: int, image_size: int, seed: int = 0) -> np.ndarray:
    """uint8 (n, 3, S, S): what the training loader hands the train step."""
    return np.random.default_rng(seed).integers(0, 256, (n, 3, image_size, image_size),
                                                dtype=np.uint8)


def random_images(n: int, image_size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, 3, image_size, image_size)).astype(
        np.float32)


def _base_result(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    return {"device": args.device, "mode": args.mode, "threads": args.threads,
            "batch_size": args.batch_size,
            "warmup": args.warmup, "steps": args.steps,
            "kernel_fusion": getattr(args, "kernel_fusion_active", False), **extra}


# ---- encode --preset / forward: the model on random inputs ----------------------------------


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny", help="model preset (tiny, small, ViT-B-32...)")
    parser.add_argument("--batch-size", type=int, default=64)
    add_common_arguments(parser)


def _build_model(args: argparse.Namespace):
    setup_mindspore(args)
    import mindspore as ms

    from clipms.config import get_preset
    from clipms.model import CLIP

    cfg = get_preset(args.preset)
    net = CLIP(cfg)
    net.set_train(False)
    images = ms.Tensor(random_images(args.batch_size, cfg.vision.image_size))
    tokens = ms.Tensor(random_tokens(args.batch_size, cfg.text.context_length,
                                     cfg.text.vocab_size))
    return net, images, tokens


def run_encode(args: argparse.Namespace) -> dict[str, Any]:
    """encode_image and encode_text (no gradient), each on a batch; one line with both rates."""
    net, images, tokens = _build_model(args)
    cpu: list[float] = []
    image_ms = statistics.median(
        time_steps(lambda: net.encode_image(images).asnumpy(), args.warmup, args.steps, cpu))
    text_ms = statistics.median(
        time_steps(lambda: net.encode_text(tokens).asnumpy(), args.warmup, args.steps, cpu))
    n = args.batch_size
    return _base_result(
        args, bench="encode", preset=args.preset,
        images_per_s=round(n / image_ms * 1000, 2), texts_per_s=round(n / text_ms * 1000, 2),
        median_step_ms=round(image_ms + text_ms, 2), median_image_step_ms=round(image_ms, 2),
        median_text_step_ms=round(text_ms, 2), cpu_image_step_ms=round(cpu[0], 1),
        cpu_text_step_ms=round(cpu[1], 1),
    )


def run_forward(args: argparse.Namespace) -> dict[str, Any]:
    """CLIP construct (both towers, normalised features, exp'd scale), no gradient."""
    net, images, tokens = _build_model(args)
    cpu: list[float] = []
    step_ms = statistics.median(
        time_steps(lambda: net(images, tokens)[0].asnumpy(), args.warmup, args.steps, cpu))
    return _base_result(
        args, bench="forward", preset=args.preset,
        samples_per_s=round(args.batch_size / step_ms * 1000, 2),
        median_step_ms=round(step_ms, 2), cpu_step_ms=round(cpu[0], 1),
    )


register(Subcommand("encode", "encode_image + encode_text throughput", _add_model_arguments,
                    run_encode))
register(Subcommand("forward", "CLIP forward (both towers) throughput", _add_model_arguments,
                    run_forward))


# ---- encode --bundle: the exported MindIR graphs; retrieval: metrics time ---------------------


def _add_encode_arguments(parser: argparse.ArgumentParser) -> None:
    _add_model_arguments(parser)
    parser.add_argument("--bundle", default=None,
                        help="an export bundle (models/export): time its MindIR graphs "
                             "(ms.load + GraphCell) instead of the --preset model")


def run_bundle_encode(args: argparse.Namespace) -> dict[str, Any]:
    """The two MindIR graphs of a bundle on random inputs of the bundle's shapes."""
    setup_mindspore(args)
    import mindspore as ms

    from clipms.infer import read_bundle

    bundle = read_bundle(args.bundle)
    image_graph = ms.nn.GraphCell(ms.load(f"{args.bundle}/{bundle['image_encoder']['file']}"))
    text_graph = ms.nn.GraphCell(ms.load(f"{args.bundle}/{bundle['text_encoder']['file']}"))
    size = bundle["image_encoder"]["input"]["shape"][2]
    ctx = bundle["text_encoder"]["input"]["shape"][1]
    images = ms.Tensor(random_images(args.batch_size, size))
    tokens = ms.Tensor(random_tokens(args.batch_size, ctx, bundle["model"]["text"]["vocab_size"]))
    n, timed = args.batch_size, args.batch_size * args.steps
    cpu = time.process_time()
    image_ms = statistics.median(
        time_steps(lambda: image_graph(images).asnumpy(), args.warmup, args.steps))
    cpu_image = time.process_time() - cpu
    text_ms = statistics.median(
        time_steps(lambda: text_graph(tokens).asnumpy(), args.warmup, args.steps))
    cpu_text = time.process_time() - cpu - cpu_image
    # CPU time per item (warm-up included) is robust to a busy machine, unlike wall-clock rates.
    warm = (args.warmup + args.steps) / args.steps
    return _base_result(
        args, bench="encode", source="mindir", bundle=str(args.bundle),
        images_per_s=round(n / image_ms * 1000, 2), texts_per_s=round(n / text_ms * 1000, 2),
        median_image_step_ms=round(image_ms, 2), median_text_step_ms=round(text_ms, 2),
        cpu_ms_per_image=round(cpu_image / timed / warm * 1000, 3),
        cpu_ms_per_text=round(cpu_text / timed / warm * 1000, 3),
        load_avg_1min=round(os.getloadavg()[0], 2),
    )


def run_encode_or_bundle(args: argparse.Namespace) -> dict[str, Any]:
    return run_bundle_encode(args) if args.bundle else run_encode(args)


def _add_retrieval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--images", type=int, default=5000)
    parser.add_argument("--captions-per-image", type=int, default=5)
    parser.add_argument("--dim", type=int, default=256, help="embedding size (tiny: 256)")
    parser.add_argument("--chunk", type=int, default=512, help="rows per similarity chunk")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; the median is kept")


def run_retrieval(args: argparse.Namespace) -> dict[str, Any]:
    """clipms.metrics.retrieval_metrics on random embeddings (captions near their image)."""
    from clipms.metrics import retrieval_metrics

    rng = np.random.default_rng(0)
    images = rng.normal(size=(args.images, args.dim)).astype(np.float32)
    owners = np.repeat(np.arange(args.images), args.captions_per_image)
    texts = images[owners] + 2.0 * rng.normal(size=(owners.size, args.dim)).astype(np.float32)
    times, cpu = [], time.process_time()
    for _ in range(args.repeats):
        start = time.perf_counter()
        retrieval_metrics(images, texts, owners, chunk=args.chunk)
        times.append(time.perf_counter() - start)
    return {"bench": "retrieval", "images": args.images, "captions": int(owners.size),
            "dim": args.dim, "chunk": args.chunk, "median_s": round(statistics.median(times), 3),
            "times_s": [round(t, 3) for t in times],
            "cpu_s_per_run": round((time.process_time() - cpu) / args.repeats, 3),
            "load_avg_1min": round(os.getloadavg()[0], 2)}


register(Subcommand("encode", "encode_image + encode_text throughput (--bundle: the MindIR)",
                    _add_encode_arguments, run_encode_or_bundle))
register(Subcommand("retrieval", "time of retrieval metrics (N images x 5N captions)",
                    _add_retrieval_arguments, run_retrieval))


# ---- loader: the training input pipeline (clipms.data) ---------------------------------------


def write_synthetic_shards(out: Any, samples: int, image_size: int, per_shard: int = 256) -> Any:
    """Train shards of the synthetic dataset in the shard format (clipms.webds)."""
    import io
    from pathlib import Path

    from clipms import webds
    from clipms.prep.synthetic import make_image

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

    from clipms.data import build_train_dataset, steps_per_epoch
    from clipms.preprocess import PreprocessConfig
    from clipms.tokenizer import Tokenizer

    tokenizer = (Tokenizer.load(args.tokenizer) if args.tokenizer
                 else Tokenizer.openai(args.context_length))
    with tempfile.TemporaryDirectory(prefix="clipms-loader-") as tmp:
        shards = args.shards or write_synthetic_shards(tmp, args.samples, args.source_size)
        wanted = args.warmup + args.batches
        epochs = -(-wanted // steps_per_epoch(shards, args.batch_size, split=args.split))
        load_before, started = os.getloadavg()[0], time.perf_counter()
        dataset = build_train_dataset(shards, tokenizer, PreprocessConfig(args.image_size),
                                      args.batch_size, epochs=epochs, workers=args.workers,
                                      augment=args.augment, split=args.split)
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


# ---- train: one optimizer step of the real training graph ---------------------------------


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    _add_model_arguments(parser)
    parser.add_argument("--precision", choices=("fp32", "amp"), default="fp32")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--log-every", type=int, default=10,
                        help="steps between reads of the results (train.log_every)")


class _RepeatedBatch:
    """A BatchSource serving one pre-made batch: the loop's cost without the loader's."""

    def __init__(self, images: np.ndarray, tokens: np.ndarray, batches: int) -> None:
        self.batch, self.batches_per_epoch = (images, tokens), batches

    def stream(self, start: int, stop: int):  # noqa: ANN201 - an iterator of batches
        for _ in range(start, stop):
            yield self.batch


class _CpuClock:
    """Process CPU time from the first read-back (after graph compilation) to the end."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.seconds = 0.0

    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        if self.start is None:
            self.start = time.process_time()

    def on_train_end(self, summary: dict[str, float]) -> None:
        self.seconds = time.process_time() - (self.start or time.process_time())


def run_train(args: argparse.Namespace) -> dict[str, Any]:
    """The training loop of `stages.train` (clipms.trainer.train: the compiled step, read back
    every --log-every steps) on one random batch, i.e. everything but the data loader.
    samples/s counts every step after the first (graph compilation), as metrics/train.json."""
    setup_mindspore(args)
    from clipms.config import get_preset
    from clipms.trainer import TrainConfig, train

    steps = args.warmup + args.steps
    cfg = TrainConfig(model=get_preset(args.preset), batch_size=args.batch_size,
                      precision=args.precision, runtime=runtime_config(args), lr=args.lr,
                      max_steps=steps, warmup_steps=steps, log_every=args.log_every)
    images = random_pixels(args.batch_size, cfg.model.vision.image_size)
    tokens = random_tokens(args.batch_size, cfg.model.text.context_length,
                           cfg.model.text.vocab_size)
    clock, load_before = _CpuClock(), os.getloadavg()[0]
    summary = train(cfg, _RepeatedBatch(images, tokens, steps), None, callbacks=[clock]).summary
    return _base_result(
        args, bench="train", preset=args.preset, precision=args.precision,
        log_every=args.log_every, samples_per_s=round(summary["samples_per_s"], 2),
        timed_steps=steps - 1, cpu_step_ms=round(1000 * clock.seconds / max(1, steps - 1), 1),
        peak_rss_mb=round(summary["peak_rss_mb"], 1),
        load_avg_1m=[round(load_before, 2), round(os.getloadavg()[0], 2)])


register(Subcommand("train", "training step throughput (forward + backward + AdamW)",
                    add_train_arguments, run_train))


# ---- entry point ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clipms-bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in SUBCOMMANDS.values():
        command.add_arguments(sub.add_parser(command.name, help=command.help))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = SUBCOMMANDS[args.command].run(args)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
