"""Peer of benchmarks/quality_vs_openclip.py: open_clip trained on the same batches, val embedded.

Runs in a separate virtualenv with torch + open_clip_torch (not project dependencies):

    python3.11 -m venv PEER_VENV
    PEER_VENV/bin/pip install torch==2.14.1 torchvision==0.29.1 open_clip_torch==3.3.0 \
        numpy==1.26.4 pillow==11.1.0 tokenizers==0.21.1

(A peer venv without `tokenizers` can take it from a folder on PYTHONPATH: `PEER_VENV/bin/pip
install --no-deps --target DIR tokenizers==0.21.1`.)

The model is `open_clip.model.CLIP` built from clipms's preset (`CLIPConfig.to_openclip()`) with
open_clip's own initialisation. The training recipe is open_clip_train's (main.py / train.py):
AdamW over two parameter groups (no decay on tensors with < 2 dims, "bn"/"ln"/"bias" names and
`logit_scale`; `--wd-rule embeddings` also exempts the token and positional embeddings, clipms's
old rule), `open_clip_train.scheduler.cosine_lr` set before each step, `open_clip.loss.ClipLoss`
(or, for a model config with `init_logit_bias`, i.e. `--siglip`'s model,
`open_clip.loss.SigLipLoss` on the model's four outputs), optional global-norm clipping, and
`logit_scale` clamped to [0, ln 100] after each step. A config's `vision_cfg.patch_dropout` is
open_clip's own PatchDropout. The batches are clipms's own (`clipms.data.dataset.TrainSamples`:
same sample order, caption draw and preprocessing as clipms's trainer for the seed), so both sides
see bit-identical inputs (also a peer with numpy 2.4 and Pillow 13 against the project's numpy 1.26
and Pillow 11: the same bytes, checked); the val split is embedded from
`clipms.data.dataset.iter_eval_batches` and scored by the driver with clipms.eval.metrics. Writes
an .npz of features and a JSON line on stdout. With `--eval-every N` the val split is also scored
every N steps (the clock paused; `clipms.eval.metrics`, numpy only): the JSON's `curve` ({step,
train_s, recalls}), for the driver's time to equal quality.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import open_clip  # noqa: E402
import torch  # noqa: E402
from open_clip_train.scheduler import cosine_lr  # noqa: E402

from clipms.data.dataset import (  # noqa: E402
    TrainSamples,
    index_shards,
    iter_eval_batches,
    steps_per_epoch,
)
from clipms.data.loading import LoaderSettings  # noqa: E402
from clipms.data.preprocess import PreprocessConfig  # noqa: E402
from clipms.eval.metrics import retrieval_metrics  # noqa: E402
from clipms.text.clip_tokenizer import Tokenizer  # noqa: E402

CURVE_KEYS = ("i2t_R@1", "i2t_R@5", "i2t_R@10", "t2i_R@1", "t2i_R@5", "t2i_R@10")


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", required=True, type=Path)
    parser.add_argument("--tokenizer", required=True, type=Path)
    parser.add_argument("--model-config", required=True, type=Path,
                        help="open_clip model config JSON (from CLIPConfig.to_openclip())")
    parser.add_argument("--out", required=True, type=Path, help="features .npz to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--warmup", type=int, default=16)
    parser.add_argument("--wd", type=float, default=0.2)
    parser.add_argument("--wd-rule", choices=("openclip", "embeddings"), default="openclip")
    parser.add_argument("--grad-clip-norm", type=float, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=0,
                        help="score the val split every this many steps (0: only at the end)")
    parser.add_argument("--dump-init", type=Path, help="write the seed's initial weights to this "
                        ".safetensors and exit (for `quality_vs_openclip.py run --init openclip`)")
    return parser.parse_args()


def decay_groups(model: torch.nn.Module, wd: float, rule: str) -> list[dict]:
    """open_clip_train's two groups; `embeddings` also exempts the token/positional embeddings."""
    def exclude(n: str, p: torch.Tensor) -> bool:
        if rule == "embeddings" and "embedding" in n:
            return True
        return p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if exclude(n, p)], "weight_decay": 0.0},
            {"params": [p for n, p in named if not exclude(n, p)], "weight_decay": wd}]


def normalise(pixels: np.ndarray, preprocess: PreprocessConfig) -> torch.Tensor:
    """uint8 (N, 3, H, W) training pixels -> (x / 255 - mean) / std, as clipms's step does on the
    device (`clipms.train.step.PixelNormalize`)."""
    mean = torch.tensor(preprocess.mean, dtype=torch.float32).reshape(1, 3, 1, 1)
    std = torch.tensor(preprocess.std, dtype=torch.float32).reshape(1, 3, 1, 1)
    return (torch.from_numpy(pixels).float() / 255.0 - mean) / std


class Clock:
    """Training seconds: wall time since the start, without the pauses to score the val split."""

    def __init__(self) -> None:
        self.started, self.paused = time.perf_counter(), 0.0

    def seconds(self) -> float:
        return time.perf_counter() - self.started - self.paused


def train(model: torch.nn.Module, samples: TrainSamples, args: argparse.Namespace,
          clock: Clock, check=None) -> list[float]:  # noqa: ANN001 - check(step) scores
    optimizer = torch.optim.AdamW(decay_groups(model, args.wd, args.wd_rule), lr=args.lr,
                                  betas=(0.9, 0.98), eps=1e-6)
    scheduler = cosine_lr(optimizer, args.lr, args.warmup, args.steps)
    siglip = model.logit_bias is not None  # open_clip_train: --siglip makes the bias
    loss_fn = open_clip.loss.SigLipLoss() if siglip else open_clip.loss.ClipLoss()
    losses = []
    model.train()
    for step in range(args.steps):
        scheduler(step)
        items = [samples.load(int(i), step // samples.steps_per_epoch)
                 for i in samples.sample_ids(step)]
        images = normalise(np.stack([image for image, _ in items]), samples.preprocess)
        tokens = torch.from_numpy(np.stack([text for _, text in items])).long()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(*model(images, tokens))  # features, scale (and the bias, for SigLIP)
        loss.backward()
        if args.grad_clip_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip_norm, norm_type=2.0)
        optimizer.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        losses.append(loss.item())
        if step % 10 == 0 or step == args.steps - 1:
            print(f"openclip step {step + 1}/{args.steps} loss {losses[-1]:.4f}", file=sys.stderr,
                  flush=True)
        if check is not None and args.eval_every and (step + 1) % args.eval_every == 0:
            check(step + 1)
            model.train()
    return losses


@torch.inference_mode()
def embed_val(model: torch.nn.Module, shards: Path, tokenizer: Tokenizer,
              preprocess: PreprocessConfig) -> dict[str, np.ndarray]:
    model.eval()
    images, texts, owners, n = [], [], [], 0
    for batch in iter_eval_batches(shards, preprocess, 128, split="val"):
        images.append(model.encode_image(torch.from_numpy(batch.images)).numpy())
        for captions in batch.captions:
            tokens = torch.from_numpy(tokenizer.encode(captions)).long()
            texts.append(model.encode_text(tokens).numpy())
            owners.extend([n] * len(captions))
            n += 1
    return {"image_features": np.concatenate(images), "text_features": np.concatenate(texts),
            "text_to_image": np.asarray(owners, np.int64)}


def main() -> None:
    args = _parse()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = open_clip.model.CLIP(**json.loads(args.model_config.read_text()))
    if args.dump_init:
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(args.dump_init))
        return
    tokenizer = Tokenizer.load(args.tokenizer)
    preprocess = PreprocessConfig(image_size=model.visual.image_size[0])
    epochs = -(-args.steps // steps_per_epoch(args.shards, args.batch_size))
    samples = TrainSamples(index_shards(args.shards, "train"), tokenizer, preprocess,
                           args.batch_size, LoaderSettings(seed=args.seed), epochs=epochs)
    clock, curve = Clock(), []

    def check(step: int) -> None:
        at, began = clock.seconds(), time.perf_counter()
        val = embed_val(model, args.shards, tokenizer, preprocess)
        found = retrieval_metrics(val["image_features"], val["text_features"],
                                  val["text_to_image"])
        clock.paused += time.perf_counter() - began
        curve.append({"step": step, "train_s": round(at, 2),
                      **{k: round(float(found[k]), 4) for k in CURVE_KEYS}})

    losses = train(model, samples, args, clock, check)
    train_s = clock.seconds()
    np.savez(args.out, **embed_val(model, args.shards, tokenizer, preprocess))
    print(json.dumps({"side": "open_clip", "peer": f"open_clip {open_clip.__version__}, torch "
                      f"{torch.__version__}", "final_loss": losses[-1],
                      "train_s": round(train_s, 1), "curve": curve,
                      "logit_bias": None if model.logit_bias is None
                      else float(model.logit_bias.detach()),
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}),
          flush=True)


if __name__ == "__main__":
    main()
