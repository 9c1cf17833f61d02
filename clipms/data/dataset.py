"""Webdataset shards -> training batches (mindspore.dataset) and evaluation batches (numpy).

Contract (the trainer and the evaluation/export code import these):

Input: `<shards_dir>/manifest.json` and the shards it lists (`train/000000.tar`, ...), each sample
`<key>.jpg` + `<key>.json` ({"captions": [...], "labels": {...} | null, ...}), in the shard format
that `clipms.data.webds` owns (key rule, key format, manifest).

Training
  `steps_per_epoch(shards_dir, batch_size, world_size=1, split="train") -> int`
      = manifest samples // (batch_size * world_size): every epoch drops the remainder.
  `build_train_dataset(shards_dir, tokenizer, preprocess, batch_size, loader=LoaderSettings(), *,
                       epochs=1, start_step=0, stop_step=None, split="train")
      -> mindspore.dataset.Dataset`, `loader` the run's `clipms.data.loading.LoaderSettings`
      (seed, rank, world size, workers, augment, decode, shuffle window, grouping)
      Yields (image uint8 (B, 3, S, S), text int32 (B, context_length)) for the global steps
      start_step .. (stop_step or epochs * steps_per_epoch) - 1 in order (so `start_step` resumes mid-run and the
      batches are the ones an uninterrupted run would have seen). Iterate it once:
      `for image, text in ds.create_tuple_iterator(num_epochs=1, output_numpy=True)`.
      - The order (clipms.data.sampling): shuffled per epoch, seeded by (seed, epoch), within windows
        of `shuffle_window_shards` shards (0 = the whole split); each global batch of B*W split
        into the ranks' disjoint contiguous shares of B; with `group_by` (label fields) that
        `group_fraction` of each epoch's global batches share those labels' values (hard
        negatives). A DataError names the field when a sample's labels lack it.
      - One caption per image per epoch, drawn uniformly with a generator seeded by
        (seed, epoch, crc32(key)): independent of rank, world size and worker count.
      - `loader.augment`: open_clip's training crop (RandomResizedCrop scale 0.9-1.0, ratio 3/4-4/3,
        same interpolation); otherwise the evaluation transform of `clipms.data.preprocess`.
      - Decoding runs in `loader.workers` processes (GeneratorDataset over random access, which measured
        faster than an iterable), the order stays deterministic.
  `TrainSamples`: the random-access source behind it (`sample_ids(step)` tells which samples a
      rank's batch holds, without decoding anything).

Evaluation
  `iter_eval_batches(shards_dir, preprocess, batch_size, split="val", workers=2)
      -> Iterator[EvalBatch]`: every sample of the split exactly once, in a fixed order (manifest
      shard order, then order within the shard), the last batch possibly smaller.
      `EvalBatch(images float32 (b, 3, S, S), keys list[str], captions list[list[str]] (ALL of
      them), labels list[dict | None])`.
  `eval_sample_count(shards_dir, split="val")` from the manifest.
  `iter_captions(shards_dir, split)`: every caption of a split (the tokenizer stage trains on it).

Errors: `DataError` naming the file/shard/key: a missing or malformed manifest, a shard whose sample
count differs from the manifest, a truncated tar, a key not in the key format, a sample without
image/json/captions.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from clipms.data import webds
from clipms.data.decode import DEVICE_DECODE_FORMATS, device_transforms
from clipms.data.loading import DEFAULT_LOADER, LoaderSettings
from clipms.data.preprocess import (
    INTERPOLATIONS,
    PreprocessConfig,
    PreprocessError,
    center_crop,
    check_pixels,
    decode_image,
    preprocess_image,
    resize_shorter_side,
)
from clipms.data.sampling import BatchOrder, SamplingError, group_ids, sample_rng
from clipms.text.clip_tokenizer import Tokenizer
from clipms.data.webds import DataError  # the shard format's error type, raised for loader errors too

log = logging.getLogger(__name__)
RRC_SCALE = (0.9, 1.0)  # open_clip's default RandomResizedCrop for training
RRC_RATIO = (3 / 4, 4 / 3)


# --- manifest and index ---------------------------------------------------------------------------
def split_sample_count(shards_dir: Path | str, split: str) -> int:
    """Samples in a split, from the manifest (no shard is read)."""
    entry = webds.split_entry(webds.read_manifest(shards_dir), split, str(shards_dir))
    return int(entry.get("samples", sum(int(s["samples"]) for s in entry["shards"])))


def eval_sample_count(shards_dir: Path | str, split: str = "val") -> int:
    return split_sample_count(shards_dir, split)


def steps_per_epoch(shards_dir: Path | str, batch_size: int, world_size: int = 1,
                    split: str = "train") -> int:
    """Full global batches per epoch (the remainder is dropped, differently each epoch)."""
    if batch_size < 1 or world_size < 1:
        raise DataError(f"batch_size and world_size must be >= 1, got {batch_size}, {world_size}")
    return split_sample_count(shards_dir, split) // (batch_size * world_size)


@dataclass
class ShardIndex:
    """Where each sample of a split lives: its shard, and the spans of its image and json."""

    shards: list[str]
    keys: list[str] = field(default_factory=list)
    shard_of: list[int] = field(default_factory=list)
    image: list[webds.Span] = field(default_factory=list)
    meta: list[webds.Span] = field(default_factory=list)
    shard_starts: list[int] = field(default_factory=list)  # first sample index of each shard

    def __len__(self) -> int:
        return len(self.keys)

    def read(self, i: int, handles: dict[int, Any] | None = None) -> tuple[bytes, dict[str, Any]]:
        """Image bytes and parsed json of sample i (`handles` caches open shard files)."""
        return self._read(i, (self.image[i], self.meta[i]), handles)

    def read_meta(self, i: int, handles: dict[int, Any] | None = None) -> dict[str, Any]:
        """Only the parsed json of sample i."""
        return self._read(i, (self.meta[i],), handles)[0]

    def _read(self, i: int, spans: tuple[webds.Span, ...],
              handles: dict[int, Any] | None) -> tuple[Any, ...]:
        shard = self.shard_of[i]
        handle = handles.get(shard) if handles is not None else None
        if handle is None:
            handle = open(self.shards[shard], "rb")  # noqa: SIM115 - closed below or by the owner
            if handles is not None:
                handles[shard] = handle
        try:
            data = [webds.read_span(handle, span) for span in spans]
            return (*data[:-1], json.loads(data[-1]))
        except (OSError, ValueError) as err:
            raise DataError(f"{self.shards[shard]}: sample {self.keys[i]!r}: {err}") from err
        finally:
            if handles is None:
                handle.close()


def index_shards(shards_dir: Path | str, split: str) -> ShardIndex:
    """Read the tar headers (not the data) of every shard of `split` listed in the manifest."""
    shards_dir = Path(shards_dir)
    entry = webds.split_entry(webds.read_manifest(shards_dir), split,
                              str(shards_dir / webds.MANIFEST))
    index = ShardIndex(shards=[])
    for shard_id, shard in enumerate(entry["shards"]):
        path = shards_dir / shard["name"]
        index.shards.append(str(path))
        index.shard_starts.append(len(index))
        excluded, found = webds.excluded_keys(shard), 0
        for key, spans in webds.index_tar(path).items():
            found += 1
            if key not in excluded:  # no longer in the split; the tar is kept as it was
                _add_sample(index, shard_id, path, key, spans)
        if found != int(shard["samples"]):
            raise DataError(f"{path}: {found} samples, but the manifest says {shard['samples']} "
                            "(shard changed after the manifest was written?)")
    return index


def _add_sample(index: ShardIndex, shard_id: int, path: Path, key: str,
                spans: dict[str, webds.Span]) -> None:
    webds.check_key(key, str(path))
    image_ext = webds.image_ext(spans)
    if image_ext is None or "json" not in spans:
        raise DataError(f"{path}: sample {key!r} lacks an image or a .json (has {sorted(spans)})")
    index.keys.append(key)
    index.shard_of.append(shard_id)
    index.image.append(spans[image_ext])
    index.meta.append(spans["json"])


def captions_of(meta: dict[str, Any], key: str) -> list[str]:
    captions = meta.get("captions")
    if not isinstance(captions, list) or not captions or not all(
            isinstance(c, str) for c in captions):
        raise DataError(f"sample {key!r}: .json has no non-empty 'captions' list of strings")
    return captions


def split_labels(index: ShardIndex) -> list[dict[str, Any] | None]:
    """Every sample's json `labels` (None where absent), reading only the .json members."""
    handles: dict[int, Any] = {}
    try:
        labels = [index.read_meta(i, handles).get("labels") for i in range(len(index))]
    finally:
        for handle in handles.values():
            handle.close()
    return [label if isinstance(label, dict) else None for label in labels]


def iter_captions(shards_dir: Path | str, split: str = "train") -> Iterator[str]:
    """Every caption of every sample of `split`, reading only the .json members (to train the
    tokenizer)."""
    index = index_shards(shards_dir, split)
    handles: dict[int, Any] = {}
    try:
        for i, key in enumerate(index.keys):
            yield from captions_of(index.read_meta(i, handles), key)
    finally:
        for handle in handles.values():
            handle.close()


# --- training -------------------------------------------------------------------------------------
def random_resized_crop(image: Image.Image, size: int, interpolation: str,
                        rng: np.random.Generator) -> Image.Image:
    """torchvision's RandomResizedCrop algorithm with open_clip's scale/ratio, then resize."""
    width, height = image.size
    area = width * height
    box = None
    for _ in range(10):
        target = area * rng.uniform(*RRC_SCALE)
        ratio = math.exp(rng.uniform(math.log(RRC_RATIO[0]), math.log(RRC_RATIO[1])))
        w, h = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < w <= width and 0 < h <= height:
            top, left = int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1))
            box = (left, top, left + w, top + h)
            break
    if box is None:  # fall back to the largest centred crop, as torchvision does
        side = min(width, height)
        left, top = (width - side) // 2, (height - side) // 2
        box = (left, top, left + side, top + side)
    return image.resize((size, size), INTERPOLATIONS[interpolation], box=box)


def to_uint8_chw(image: Image.Image) -> np.ndarray:
    """(3, H, W) uint8 pixels of an RGB image: `to_normalized_array`'s input, channels first."""
    return np.ascontiguousarray(np.asarray(image, dtype=np.uint8).transpose(2, 0, 1))


def normalize_pixels(pixels: np.ndarray, cfg: PreprocessConfig) -> np.ndarray:
    """uint8 (..., 3, H, W) -> float32 (x / 255 - mean) / std: on the host what the train step
    does on the device (clipms.train.step.PixelNormalize), the operations and order of
    `to_normalized_array`, so the result is bit for bit `preprocess_image`'s."""
    shape = (3, 1, 1)
    mean = np.asarray(cfg.mean, dtype=np.float32).reshape(shape)
    std = np.asarray(cfg.std, dtype=np.float32).reshape(shape)
    return (pixels.astype(np.float32) / np.float32(255.0) - mean) / std


class TrainSamples:
    """Random-access training samples for one rank: item i = sample `within` of step `step`."""

    def __init__(self, index: ShardIndex, tokenizer: Tokenizer, preprocess: PreprocessConfig,
                 batch_size: int, loader: LoaderSettings = DEFAULT_LOADER, *, epochs: int,
                 start_step: int = 0, stop_step: int | None = None) -> None:
        if batch_size < 1 or epochs < 1:
            raise DataError(f"batch_size and epochs must be >= 1, got {batch_size}, {epochs}")
        self.index, self.tokenizer, self.preprocess = index, tokenizer, preprocess
        self.batch_size, self.loader = batch_size, loader
        try:
            group_by = loader.group_by
            groups = group_ids(split_labels(index), index.keys, group_by) if group_by else None
            self.order = BatchOrder(index, batch_size, loader, groups)
        except SamplingError as err:
            raise DataError(str(err)) from err
        self.steps_per_epoch = self.order.steps_per_epoch
        if self.steps_per_epoch == 0:
            raise DataError(f"{len(index)} samples cannot fill one global batch of "
                            f"{batch_size} x {loader.world_size} ranks")
        self.start_step, self.end_step = start_step, epochs * self.steps_per_epoch
        if stop_step is not None:  # a run that ends mid-epoch: nothing decoded past its end
            if not start_step <= stop_step <= self.end_step:
                raise DataError(f"stop_step {stop_step} outside {start_step}..{self.end_step}")
            self.end_step = stop_step
        if not 0 <= start_step <= self.end_step:
            raise DataError(f"start_step {start_step} outside 0..{self.end_step}")
        self._handles: dict[int, Any] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return (self.end_step - self.start_step) * self.batch_size

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handles": {}}  # open files do not cross processes

    def sample_ids(self, step: int) -> np.ndarray:
        """Indices (into the ShardIndex) of this rank's batch at global step `step`."""
        return self.order.sample_ids(step)

    def caption(self, sample: int, epoch: int, captions: list[str]) -> str:
        rng = sample_rng(self.loader.seed, epoch, self.index.keys[sample])
        return captions[int(rng.integers(len(captions)))]

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        step, within = divmod(int(i), self.batch_size)
        step += self.start_step
        sample = int(self.sample_ids(step)[within])
        return self.load(sample, step // self.steps_per_epoch)

    def load(self, sample: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(image (3, S, S) uint8, tokens (ctx,) int32) of a sample as drawn in `epoch`: the
        pixels `preprocess_image` would normalise (the train step normalises them on the
        device, so a batch moves at 1 byte a pixel)."""
        if os.getpid() != self._pid:  # a forked worker: its own file handles
            self._handles, self._pid = {}, os.getpid()
        key = self.index.keys[sample]
        image_bytes, meta = self.index.read(sample, self._handles)
        text = self.caption(sample, epoch, captions_of(meta, key))
        try:
            cfg = self.preprocess
            rgb = decode_image(image_bytes, key, cfg.max_pixels)
            if self.loader.augment:
                rng = sample_rng(self.loader.seed + 1, epoch, key)  # independent of the caption draw
                crop = random_resized_crop(rgb, cfg.image_size, cfg.interpolation, rng)
            else:
                resized = resize_shorter_side(rgb, cfg.image_size, cfg.interpolation)
                crop = center_crop(resized, cfg.image_size)
            image = to_uint8_chw(crop)
        except PreprocessError as err:
            raise DataError(f"{self.index.shards[self.index.shard_of[sample]]}: {err}") from err
        return image, self.tokenizer.encode([text])[0]


class EncodedTrainSamples(TrainSamples):
    """TrainSamples that hand over the encoded image (1-D uint8) for MindSpore's own decoder.
    The header is still read here: only allowed formats within the pixel limit go through."""

    def load(self, sample: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        if os.getpid() != self._pid:
            self._handles, self._pid = {}, os.getpid()
        key = self.index.keys[sample]
        image_bytes, meta = self.index.read(sample, self._handles)
        text = self.caption(sample, epoch, captions_of(meta, key))
        shard = self.index.shards[self.index.shard_of[sample]]
        try:
            with Image.open(io.BytesIO(image_bytes), formats=DEVICE_DECODE_FORMATS) as header:
                check_pixels(header.size, self.preprocess.max_pixels, key)
        except PreprocessError as err:
            raise DataError(f"{shard}: {err}") from err
        except Image.DecompressionBombError as err:  # PIL's own limit, checked inside open()
            raise DataError(f"{shard}: {key}: over the pixel limit ({err})") from err
        except Exception as err:  # noqa: BLE001 - PIL raises many types for a bad header
            raise DataError(f"{shard}: sample {key!r} is not a "
                            f"{' or '.join(DEVICE_DECODE_FORMATS)} image ({err})") from err
        return np.frombuffer(image_bytes, dtype=np.uint8), self.tokenizer.encode([text])[0]


def build_train_dataset(shards_dir: Path | str, tokenizer: Tokenizer, preprocess: PreprocessConfig,
                        batch_size: int, loader: LoaderSettings = DEFAULT_LOADER, *,
                        epochs: int = 1, start_step: int = 0, stop_step: int | None = None,
                        split: str = "train") -> Any:
    """The mindspore.dataset pipeline of (image, text) batches; see the module docstring.
    `loader.decode` "cpu"/"ascend" decode in `loader.workers` C++ threads of the dataset (no
    Python worker processes, no shared memory) and do not augment."""
    # Decode workers are forked after the tokenizer may have used its Rust thread pool, which does
    # not survive a fork; one caption per call needs no parallelism anyway.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    kind = TrainSamples if loader.decode == "pil" else EncodedTrainSamples
    source = kind(index_shards(shards_dir, split), tokenizer, preprocess, batch_size, loader,
                  epochs=epochs, start_step=start_step, stop_step=stop_step)
    return decoded_batches(source, loader).batch(batch_size, drop_remainder=True)


def decoded_batches(source: TrainSamples, loader: LoaderSettings) -> Any:
    """`source` as a mindspore.dataset of (image, text) rows decoded in `loader.workers`: Python
    processes for "pil", the dataset's C++ threads for the device decoders."""
    import mindspore.dataset as ds  # heavy: only the training path needs it

    workers = loader.workers
    if loader.decode == "pil":
        return ds.GeneratorDataset(source, column_names=["image", "text"], shuffle=False,
                                   num_parallel_workers=max(1, workers),
                                   python_multiprocessing=workers > 1)
    # reading encoded bytes is cheap: one reader, the decode fans out in C++
    dataset = ds.GeneratorDataset(source, column_names=["image", "text"], shuffle=False,
                                  num_parallel_workers=1, python_multiprocessing=False)
    return dataset.map(device_transforms(source.preprocess, loader.decode),
                       input_columns=["image"], num_parallel_workers=max(1, workers))


# --- evaluation -----------------------------------------------------------------------------------
@dataclass
class EvalBatch:
    images: np.ndarray  # (b, 3, S, S) float32, preprocessed
    keys: list[str]
    captions: list[list[str]]  # every caption of each image
    labels: list[dict[str, Any] | None]


def iter_eval_batches(shards_dir: Path | str, preprocess: PreprocessConfig, batch_size: int,
                      split: str = "val", workers: int = 2,
                      skipped: list[str] | None = None) -> Iterator[EvalBatch]:
    """Every decodable sample of `split` once, in manifest/shard order, decoded in `workers`
    threads (PIL releases the GIL while decoding and resizing). An image the decoder refuses
    (another format, over the pixel limit, broken data) is a bad sample, not a crash: it is left
    out, logged, and its key appended to `skipped` when a list is given."""
    if batch_size < 1:
        raise DataError(f"batch_size must be >= 1, got {batch_size}")
    index = index_shards(shards_dir, split)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for start in range(0, len(index), batch_size):
            ids = range(start, min(start + batch_size, len(index)))
            items = list(pool.map(lambda i: _eval_item(index, i, preprocess), ids))
            good = [(i, item) for i, item in zip(ids, items, strict=True) if item is not None]
            if skipped is not None:
                skipped.extend(index.keys[i] for i, item in zip(ids, items, strict=True)
                               if item is None)
            if not good:
                continue
            yield EvalBatch(images=np.stack([item[0] for _, item in good]),
                            keys=[index.keys[i] for i, _ in good],
                            captions=[item[1] for _, item in good],
                            labels=[item[2] for _, item in good])


def _eval_item(index: ShardIndex, i: int, preprocess: PreprocessConfig
               ) -> tuple[np.ndarray, list[str], dict | None] | None:
    """(image, captions, labels), or None for an image the decoder refuses."""
    image_bytes, meta = index.read(i)
    key = index.keys[i]
    try:
        image = preprocess_image(image_bytes, preprocess, name=key)
    except PreprocessError as err:
        log.warning("%s: %s: bad sample, skipped", index.shards[index.shard_of[i]], err)
        return None
    labels = meta.get("labels")
    return image, captions_of(meta, key), labels if isinstance(labels, dict) else None
