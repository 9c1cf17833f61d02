"""Export a random-init model of a preset as a bundle, to benchmark MindIR inference before (or
without) a trained model: `python benchmarks/export_random_bundle.py --preset tiny --out DIR`,
then `python -m benchmarks.throughput encode --bundle DIR --batch-size 64`. Speed does not depend
on the weights."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import clipms  # noqa: F401  (MindSpore's runtime switches before it is imported)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import mindspore as ms

    from clipms.data.preprocess import PreprocessConfig
    from clipms.deploy.mindir import export_bundle
    from clipms.model.architecture import get_preset
    from clipms.model.clip import CLIP
    from clipms.text.clip_tokenizer import Tokenizer

    ms.set_seed(0)
    cfg = get_preset(args.preset)
    net = CLIP(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = Path(tmp) / "tokenizer.json"
        Tokenizer.openai(cfg.text.context_length).save(tokenizer)
        export_bundle(net, PreprocessConfig(cfg.vision.image_size), tokenizer, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
