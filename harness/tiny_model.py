"""A tiny random-init CLIP, saved the way the train stage saves its outputs (export/infer tests).

`write_trained(dir, seed)` saves `clip.ckpt` (ms.save_checkpoint of the CLIP Cell), `clip.json` and
`tokenizer.json` exactly as the contract between train, evaluate and export describes them.
"""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import numpy as np
from PIL import Image

import clipms  # noqa: F401  (sets MindSpore's runtime switches before it is imported)
from clipms.data import webds
from clipms.data.preprocess import PreprocessConfig
from clipms.model.architecture import CLIPConfig, TextConfig, VisionConfig, get_preset
from clipms.text.clip_tokenizer import Tokenizer
from clipms.utils.jsonio import write_json

CAPTIONS = [f"a {s} {c} {shape} on the {p}" for s in ("small", "large") for c in ("red", "blue")
            for shape in ("circle", "square", "triangle") for p in ("left", "right")]
# A micro CLIP for training-loop tests: 16-pixel images of 4 patches, an 8-token context.
MICRO = CLIPConfig(
    embed_dim=16,
    vision=VisionConfig(image_size=16, patch_size=8, width=32, layers=1, head_width=16),
    text=TextConfig(context_length=8, vocab_size=40, width=32, heads=2, layers=1),
)


def tiny_config(vocab_size: int, context_length: int = 16) -> CLIPConfig:
    """One layer per tower, width 64: compiles and exports in seconds."""
    base = get_preset("tiny")
    vision = dataclasses.replace(base.vision, image_size=32, patch_size=8, width=64, layers=1,
                                 head_width=32)
    text = dataclasses.replace(base.text, context_length=context_length, vocab_size=vocab_size,
                               width=64, heads=2, layers=1)
    return dataclasses.replace(base, embed_dim=32, vision=vision, text=text)


def write_trained(folder: Path, seed: int = 0,
                  logit_bias: float | None = None) -> dict[str, Path]:
    """clip.ckpt / clip.json / tokenizer.json of a random-init tiny model (weights from seed);
    with `logit_bias`, a SigLIP model (init_logit_bias set) whose bias has that value."""
    import mindspore as ms

    from clipms.model.clip import CLIP

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.train(CAPTIONS * 4, vocab_size=600, context_length=16)
    cfg = tiny_config(tokenizer.vocab_size)
    if logit_bias is not None:
        cfg = dataclasses.replace(cfg, init_logit_bias=logit_bias)
    ms.set_seed(seed)
    net = CLIP(cfg)
    paths = {"checkpoint": folder / "clip.ckpt", "config": folder / "clip.json",
             "tokenizer": folder / "tokenizer.json"}
    ms.save_checkpoint(net, str(paths["checkpoint"]))
    tokenizer.save(paths["tokenizer"])
    preprocess = PreprocessConfig(image_size=cfg.vision.image_size)
    write_json(paths["config"], {"model": cfg.to_dict(), "tokenizer": str(paths["tokenizer"]),
                                 "preprocess": preprocess.to_dict()})
    return paths



def export_tiny_bundle(root: Path, seed: int = 0, logit_bias: float | None = None) -> Path:
    """A real export bundle (two MindIR graphs) of a random-init tiny model, in root/bundle
    (a SigLIP model's with `logit_bias`)."""
    from clipms.deploy.mindir import export_bundle
    from clipms.train.trained import RunConfig, load_clip

    paths = write_trained(root / "trained", seed=seed, logit_bias=logit_bias)
    run = RunConfig.read(paths["config"])
    out = root / "bundle"
    export_bundle(load_clip(paths["checkpoint"], run.model), run.preprocess, paths["tokenizer"],
                  out)
    return out

def random_images(n: int, seed: int = 0, size: tuple[int, int] = (40, 48)) -> list[Image.Image]:
    """Non-square RGB images, so the resize + centre crop path is exercised."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, size=(*size[::-1], 3), dtype=np.uint8))
            for _ in range(n)]


def jpeg_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def make_index(bundle: Path, out: Path) -> Path:
    """The search index of `bundle` over 12 random pictures, as the index stage writes it."""
    from clipms.deploy.infer import Encoder
    from clipms.deploy.search import SearchOptions
    from clipms.deploy.searchindex import Item, build_index, bundle_digest

    images = random_images(12, seed=4)
    items = [Item(f"s{i:02d}", jpeg_bytes(im), f"picture {i}", "val")
             for i, im in enumerate(images)]
    build_index(Encoder(bundle, kernel_fusion=False), items, out, bundle_digest(bundle),
                SearchOptions(), thumbnail_size=16)
    return out


COLOURS = ["red", "blue", "green"]
SHAPES = ["circle", "square"]


def make_val_shards(root, n_images=11, per_shard=4):
    """Shards + manifest in the shard stage's format; image i has 1-3 captions and labels."""
    samples = split_samples(n_images, seed=0)
    webds.write_manifest(root, per_shard, {"val": webds.write_split(
        root, "val", shard_files(samples, "val"), per_shard)})
    return samples


def make_train_and_val_shards(root: Path, n_train: int = 24, n_val: int = 11,
                              per_shard: int = 8) -> None:
    """Both splits in the shard stage's format: what the tokenizer and train stages read."""
    train = split_samples(n_train, seed=1, image_seed=11, first_key=1000)
    val = split_samples(n_val, seed=0)
    webds.write_manifest(root, per_shard, {
        "train": webds.write_split(root, "train", shard_files(train, "train"), per_shard),
        "val": webds.write_split(root, "val", shard_files(val, "val"), per_shard)})


def split_samples(n_images: int, seed: int, image_seed: int = 7,
                  first_key: int = 0) -> list[tuple]:
    """(key, jpeg, captions, labels) of n random images; image i has 1-3 captions and labels
    (image 4 has none)."""
    rng = np.random.default_rng(seed)
    samples = []
    for i, image in enumerate(random_images(n_images, seed=image_seed)):
        captions = [CAPTIONS[(3 * i + j) % len(CAPTIONS)] for j in range(1 + i % 3)]
        labels = None if i == 4 else {"colour": COLOURS[i % 3], "shape": SHAPES[rng.integers(2)]}
        samples.append((f"{first_key + i:06d}", jpeg_bytes(image), captions, labels))
    return samples


def shard_files(samples: list[tuple], split: str) -> list[tuple[str, dict[str, bytes]]]:
    return [(key, {"jpg": data, "json": json.dumps({"captions": captions, "key": key,
                                                     "split": split, "labels": labels}).encode()})
            for key, data, captions, labels in samples]
