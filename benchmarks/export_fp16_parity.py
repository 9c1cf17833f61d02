"""fp16 vs fp32 MindIR export of a random-init preset: parity errors and file sizes.

    python benchmarks/export_fp16_parity.py --preset ViT-B-32

Prints one JSON line per precision (the errors clipms.deploy.mindir.parity_report gates on, the
MindIR sizes, the export time) and records them in benchmarks/results/export_fp16_parity.json
(`--results`). The bundles go to a temporary folder (`--out` to keep them). Random weights,
random normalised images and random token rows: the errors measure fp16's rounding through the
architecture, not a trained model's quality. Used for the fp16 parity bar in docs/ascend.md.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import record  # benchmarks/record.py, beside this script

import clipms  # noqa: F401  (MindSpore's environment before it is imported)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="ViT-B-32")
    parser.add_argument("--out", type=Path, help="where to write the bundles (default: a "
                        "temporary folder, removed afterwards)")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--results", type=Path,
                        help="result file (default: benchmarks/results/export_fp16_parity.json)")
    args = parser.parse_args()
    recording = record.start("export_fp16_parity")
    with tempfile.TemporaryDirectory(prefix="clipms-export-parity-") as tmp:
        rows = [measure(args, args.out or Path(tmp), precision) for precision in ("fp32", "fp16")]
    recording.write(rows, args.results)


def measure(args: argparse.Namespace, out: Path, precision: str) -> dict:
    """Export the preset at `precision` and check it against the same weights in fp32."""
    import mindspore as ms

    from benchmarks.throughput import random_images, random_tokens
    from clipms.data.preprocess import PreprocessConfig
    from clipms.deploy.mindir import export_bundle, parity_report
    from clipms.model.architecture import get_preset
    from clipms.model.clip import CLIP
    from clipms.text.clip_tokenizer import Tokenizer

    cfg = get_preset(args.preset)
    out.mkdir(parents=True, exist_ok=True)
    Tokenizer.openai(cfg.text.context_length).save(out / "tokenizer.json")
    images = random_images(args.samples, cfg.vision.image_size)
    tokens = random_tokens(args.samples, cfg.text.context_length, cfg.text.vocab_size)
    ms.set_seed(0)
    started = time.perf_counter()
    export_bundle(CLIP(cfg), PreprocessConfig(image_size=cfg.vision.image_size),
                  out / "tokenizer.json", out / precision, precision)
    seconds = time.perf_counter() - started
    ms.set_seed(0)  # the same weights again, in fp32: the reference
    report = parity_report(CLIP(cfg), out / precision, images, tokens, (1, args.samples),
                           precision)
    row = {"preset": args.preset, "precision": precision, "passed": report["passed"],
           "tolerance": report["tolerance"], "gate_metric": report["gate_metric"],
           **{k: v for k, v in report.items() if k.endswith(("_error", "_normalized"))},
           "mb": {p.name: round(p.stat().st_size / 2**20, 1)
                  for p in sorted((out / precision).glob("*.mindir"))},
           "export_s": round(seconds, 1)}
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    main()
