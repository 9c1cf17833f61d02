"""`python -m benchmarks.throughput encode` (--preset: the model; --bundle: the exported MindIR
graphs), `forward` and `retrieval` (the metrics' time)."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import numpy as np

from benchmarks.throughput.common import (
    StepTimes,
    Subcommand,
    add_model_arguments,
    base_result,
    random_images,
    random_tokens,
    register,
    setup_mindspore,
    time_steps,
    timed_steps,
)

# ---- encode --preset / forward: the model on random inputs ----------------------------------


def _build_model(args: argparse.Namespace):
    setup_mindspore(args)
    import mindspore as ms

    from clipms.model.architecture import get_preset
    from clipms.model.clip import CLIP

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
    return base_result(
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
    return base_result(
        args, bench="forward", preset=args.preset,
        samples_per_s=round(args.batch_size / step_ms * 1000, 2),
        median_step_ms=round(step_ms, 2), cpu_step_ms=round(cpu[0], 1),
    )


# ---- encode --bundle: the exported MindIR graphs; retrieval: metrics time ---------------------


def _add_encode_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--bundle", default=None,
                        help="an export bundle (models/export): time its MindIR graphs "
                             "(ms.load + GraphCell) instead of the --preset model")
    parser.add_argument("--towers", choices=("both", "text", "image"), default="both",
                        help="--bundle: the towers to time (default both)")


def _tower_result(name: str, run: StepTimes, n: int) -> dict[str, Any]:
    """A tower's rates: at the median step (`<name>s_per_s`, a step nothing interrupted) and the
    mean over the timed steps (`<name>s_per_s_mean`: total items / total time), the median step's
    ms, and CPU ms per item over the timed steps only (the warm-up's compiles left out)."""
    return {f"{name}s_per_s": round(run.median_rate(n), 2),
            f"{name}s_per_s_mean": round(run.mean_rate(n), 2),
            f"median_{name}_step_ms": round(run.median_ms, 2),
            f"cpu_ms_per_{name}": round(run.cpu_ms_per_item(n), 3)}


def run_bundle_encode(args: argparse.Namespace) -> dict[str, Any]:
    """The MindIR graphs of a bundle on random inputs of the bundle's shapes (the tokens are made
    up front: tokenizing is not the model's work)."""
    setup_mindspore(args)
    import mindspore as ms

    from clipms.deploy.infer import read_bundle

    bundle = read_bundle(args.bundle)
    result: dict[str, Any] = {}
    n = args.batch_size
    if args.towers in ("both", "image"):
        graph = ms.nn.GraphCell(ms.load(f"{args.bundle}/{bundle['image_encoder']['file']}"))
        images = ms.Tensor(random_images(n, bundle["image_encoder"]["input"]["shape"][2]))
        run = timed_steps(lambda: graph(images).asnumpy(), args.warmup, args.steps)
        result.update(_tower_result("image", run, n))
    if args.towers in ("both", "text"):
        graph = ms.nn.GraphCell(ms.load(f"{args.bundle}/{bundle['text_encoder']['file']}"))
        tokens = ms.Tensor(random_tokens(n, bundle["text_encoder"]["input"]["shape"][1],
                                         bundle["model"]["text"]["vocab_size"]))
        run = timed_steps(lambda: graph(tokens).asnumpy(), args.warmup, args.steps)
        result.update(_tower_result("text", run, n))
    return base_result(args, bench="encode", source="mindir", bundle=str(args.bundle),
                       towers=args.towers, **result, load_avg_1min=round(os.getloadavg()[0], 2))


def run_encode_or_bundle(args: argparse.Namespace) -> dict[str, Any]:
    return run_bundle_encode(args) if args.bundle else run_encode(args)


def _add_retrieval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--images", type=int, default=5000)
    parser.add_argument("--captions-per-image", type=int, default=5)
    parser.add_argument("--dim", type=int, default=256, help="embedding size (tiny: 256)")
    parser.add_argument("--chunk", type=int, default=512, help="rows per similarity chunk")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; the median is kept")


def run_retrieval(args: argparse.Namespace) -> dict[str, Any]:
    """clipms.eval.metrics.retrieval_metrics on random embeddings (captions near their image)."""
    from clipms.eval.metrics import retrieval_metrics

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
register(Subcommand("forward", "CLIP forward (both towers) throughput", add_model_arguments,
                    run_forward))
register(Subcommand("retrieval", "time of retrieval metrics (N images x 5N captions)",
                    _add_retrieval_arguments, run_retrieval))
