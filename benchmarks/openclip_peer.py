"""The peer: the same benchmark work in open_clip on PyTorch (CPU, fp32), same JSON keys.

Not a project dependency. Run it with a separate virtualenv that has torch + open_clip_torch:

    python3 -m venv ~/venvs/openclip
    ~/venvs/openclip/bin/pip install torch==2.14.1 torchvision==0.29.1 open_clip_torch==3.3.0
    ~/venvs/openclip/bin/python benchmarks/openclip_peer.py encode --preset tiny --batch-size 64
    ~/venvs/openclip/bin/python benchmarks/openclip_peer.py forward --preset tiny --batch-size 64
    ~/venvs/openclip/bin/python benchmarks/openclip_peer.py train --preset tiny --batch-size 64

The architecture comes from clipms's own preset (`CLIPConfig.to_openclip()`), and inputs and timing
from `benchmarks.throughput` (both pure Python + numpy), so the two sides do exactly the same work.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import open_clip  # noqa: E402
import torch  # noqa: E402

from benchmarks.throughput import random_images, random_tokens, time_steps  # noqa: E402
from clipms.model.architecture import get_preset  # noqa: E402


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("bench", choices=("encode", "forward", "train"))
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lr", type=float, default=5e-4)
    return parser.parse_args()


def main() -> None:
    args = _parse()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = get_preset(args.preset)
    model = open_clip.model.CLIP(**cfg.to_openclip())
    images = torch.from_numpy(random_images(args.batch_size, cfg.vision.image_size))
    tokens = torch.from_numpy(
        random_tokens(args.batch_size, cfg.text.context_length, cfg.text.vocab_size)).long()
    n = args.batch_size
    cpu: list[float] = []  # process CPU ms per timed step, appended by time_steps
    result = {"bench": args.bench, "preset": args.preset, "mode": "pytorch-eager",
              "threads": args.threads, "batch_size": n, "warmup": args.warmup,
              "steps": args.steps, "peer": f"open_clip {open_clip.__version__}, "
              f"torch {torch.__version__}"}
    if args.bench == "train":
        model.train()
        loss_fn = open_clip.loss.ClipLoss()
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.2)

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            image_features, text_features, scale = model(images, tokens)
            loss = loss_fn(image_features, text_features, scale)
            loss.backward()
            optimizer.step()

        step_ms = statistics.median(time_steps(step, args.warmup, args.steps, cpu))
        result |= {"samples_per_s": round(n / step_ms * 1000, 2),
                   "median_step_ms": round(step_ms, 2), "cpu_step_ms": round(cpu[0], 1)}
    else:
        model.eval()
        with torch.inference_mode():
            if args.bench == "encode":
                image_ms = statistics.median(
                    time_steps(lambda: model.encode_image(images), args.warmup, args.steps, cpu))
                text_ms = statistics.median(
                    time_steps(lambda: model.encode_text(tokens), args.warmup, args.steps, cpu))
                result |= {"images_per_s": round(n / image_ms * 1000, 2),
                           "texts_per_s": round(n / text_ms * 1000, 2),
                           "median_step_ms": round(image_ms + text_ms, 2),
                           "median_image_step_ms": round(image_ms, 2),
                           "median_text_step_ms": round(text_ms, 2),
                           "cpu_image_step_ms": round(cpu[0], 1),
                           "cpu_text_step_ms": round(cpu[1], 1)}
            else:
                step_ms = statistics.median(
                    time_steps(lambda: model(images, tokens), args.warmup, args.steps, cpu))
                result |= {"samples_per_s": round(n / step_ms * 1000, 2),
                           "median_step_ms": round(step_ms, 2), "cpu_step_ms": round(cpu[0], 1)}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
