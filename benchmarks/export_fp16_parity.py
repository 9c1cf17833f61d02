"""fp16 vs fp32 MindIR export of a random-init preset: parity errors and file sizes.

    python benchmarks/export_fp16_parity.py --preset ViT-B-32 --out /tmp/export-parity

Prints one JSON line per precision (the errors clipms.deploy.export.parity_report gates on, the
MindIR sizes, the export time). Random weights, random normalised images and random token rows: the
errors measure fp16's rounding through the architecture, not a trained model's quality. Used for
the fp16 parity bar in docs/ascend.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import clipms  # noqa: F401  (MindSpore's environment before it is imported)


def main() -> None:
    import mindspore as ms

    from clipms.bench import random_images, random_tokens
    from clipms.data.preprocess import PreprocessConfig
    from clipms.deploy.export import export_bundle, parity_report
    from clipms.model.clip import CLIP
    from clipms.model.config import get_preset
    from clipms.text.tokenizer import Tokenizer

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="ViT-B-32")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=8)
    args = parser.parse_args()

    cfg = get_preset(args.preset)
    args.out.mkdir(parents=True, exist_ok=True)
    Tokenizer.openai(cfg.text.context_length).save(args.out / "tokenizer.json")
    images = random_images(args.samples, cfg.vision.image_size)
    tokens = random_tokens(args.samples, cfg.text.context_length, cfg.text.vocab_size)
    for precision in ("fp32", "fp16"):
        ms.set_seed(0)
        started = time.perf_counter()
        export_bundle(CLIP(cfg), PreprocessConfig(image_size=cfg.vision.image_size),
                      args.out / "tokenizer.json", args.out / precision, precision)
        seconds = time.perf_counter() - started
        ms.set_seed(0)  # the same weights again, in fp32: the reference
        report = parity_report(CLIP(cfg), args.out / precision, images, tokens,
                               (1, args.samples), precision)
        print(json.dumps({
            "preset": args.preset, "precision": precision, "passed": report["passed"],
            "tolerance": report["tolerance"], "gate_metric": report["gate_metric"],
            **{k: v for k, v in report.items() if k.endswith(("_error", "_normalized"))},
            "mb": {p.name: round(p.stat().st_size / 2**20, 1)
                   for p in sorted((args.out / precision).glob("*.mindir"))},
            "export_s": round(seconds, 1)}), flush=True)


if __name__ == "__main__":
    main()
