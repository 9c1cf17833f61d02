"""How the training loader uses its host: decode processes per rank (`train.workers: auto`) and
MindSpore's own image decoding, on the CPU or on an Ascend NPU (`train.decode`).

clipms.data.dataset builds the dataset; this module only decides how many workers and which transforms.
docs/ascend.md says what was tested here and what is taken from MindSpore's documentation.
"""

# tested by: tests/clipms/data/test_dataset_loader.py

from __future__ import annotations

import os
from typing import Any

from clipms.data.preprocess import PreprocessConfig
from clipms.data.webds import DataError

MAX_AUTO_WORKERS = 16  # "auto" stops here: more decode processes mostly cost shared memory
# Where training images are decoded: "pil" in Python worker processes (the evaluation and serving
# transform, exactly); "cpu" / "ascend" by MindSpore's vision ops in the dataset's C++ threads,
# Decode/Resize on the NPU's DVPP for "ascend" (not runnable without one).
DECODERS = ("pil", "cpu", "ascend")
DEVICE_DECODE_FORMATS = ("JPEG", "PNG")  # what the device decoders take; shards hold JPEG


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def loader_workers(setting: int | str, local_ranks: int = 1, cores: int | None = None) -> int:
    """`train.workers` resolved to decode processes per rank: an int as given; "auto" shares this
    host's usable cores evenly between its `local_ranks` training processes (at least 1, at most
    MAX_AUTO_WORKERS). The rank's own process mostly waits on its device, so it gets no core of
    its own; the worker count never changes which samples a batch holds."""
    if setting != "auto":
        if not isinstance(setting, int) or setting < 0:
            raise DataError(f"workers = {setting!r}: expected 'auto' or an integer >= 0")
        return setting
    if local_ranks < 1:
        raise DataError(f"local_ranks must be >= 1, got {local_ranks}")
    cores = usable_cores() if cores is None else cores
    return max(1, min(MAX_AUTO_WORKERS, cores // local_ranks))


def device_transforms(preprocess: PreprocessConfig, decode: str) -> list[Any]:
    """MindSpore's vision ops doing what the "pil" training path does: decode, shorter side to
    `image_size`, centre crop, CHW, as uint8 pixels (the train step normalises them on the device:
    clipms.train.step.PixelNormalize). With "ascend", Decode and Resize run on the NPU
    (`.device("Ascend")`); CenterCrop and HWC2CHW have no Ascend implementation and stay on the
    host."""
    from mindspore.dataset import vision

    inter = {"bicubic": vision.Inter.BICUBIC, "bilinear": vision.Inter.LINEAR}
    size = preprocess.image_size
    on_device = [vision.Decode(), vision.Resize(size, inter[preprocess.interpolation])]
    if decode == "ascend":
        on_device = [op.device("Ascend") for op in on_device]
    return [*on_device, vision.CenterCrop(size), vision.HWC2CHW()]
