"""The folder a training run may cache its compiled graphs in, keyed by everything they bake in.

MindSpore's compile cache checks a cached graph against a hash of the entry script and the files
it imports, leaving out every file under `sys.path` (mindspore/graph/api.py of 2.10,
`_get_compile_cache_dep_files`), then matches cached graphs by compile order. This library runs
from `sys.path` (PYTHONPATH, msrun workers, an installed package), and its train graph holds the
learning rate, warmup, total steps, clipping, loss-scale window, the pixel mean/std, world size and
rank as constants, so MindSpore's own key sees none of them: a run with another lr loaded the
previous run's graph and trained with the old lr (tests/clipms/train/test_graphcache.py, on CPU).

A run therefore caches only in `<kernel cache>/graphs/<key>/rank<r>/`, `<key>` hashing:
- the config's fingerprint (every setting that changes the weights: lr, schedule, model,
  precision, runtime device/mode/jit level/fusion, ...) and its data fingerprint;
- the digest of the training code (`clipms.utils.codehash`, the one the checkpoint fingerprint
  uses), so an edit of the step compiles anew while a comment edit does not;
- the total number of steps, the pixel mean/std, the world size (the graph averages over it), the
  precision, jit level and device once more by name, and the MindSpore version.
The rank is the folder below the key. Same key, same compile order: a rerun or a resume of the
same run finds its own graphs, anything else compiles. `key.json` in each folder says what it
holds; the folders can be deleted at any time.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from clipms.train.recipe import TrainConfig
from clipms.utils.codehash import code_digest, module_closure

# The module whose import closure (clipms.utils.codehash) is the code a training step runs.
TRAINING_ENTRY = "clipms.train.job"
GRAPHS = "graphs"


@lru_cache(maxsize=1)
def training_code_digest() -> str:
    """Digest of the training code's syntax trees (docstrings and comments left out)."""
    root = Path(__file__).resolve().parents[2]
    return code_digest(module_closure(TRAINING_ENTRY, root), root)


def graph_cache_key(cfg: TrainConfig, total_steps: int, world_size: int,
                    mean: tuple[float, ...], std: tuple[float, ...]) -> dict[str, Any]:
    """Everything a training run's graphs bake in, but the rank (a folder of its own)."""
    import mindspore as ms

    return {"config": cfg.fingerprint(), "data": cfg.data_fingerprint,
            "code": training_code_digest(), "total_steps": total_steps,
            "world_size": world_size, "pixel_mean": list(mean), "pixel_std": list(std),
            "device": cfg.runtime.device_target, "precision": cfg.precision,
            "jit_level": cfg.runtime.jit_level, "mindspore": ms.__version__}


def graph_cache_dir(base: Path | str, key: dict[str, Any], rank: int) -> Path:
    """`base/graphs/<hash of key>/rank<rank>/`, with the key written beside the rank folders."""
    text = json.dumps(key, sort_keys=True)
    run_dir = Path(base) / GRAPHS / hashlib.sha256(text.encode()).hexdigest()[:16]
    run_dir.mkdir(parents=True, exist_ok=True)
    label = run_dir / "key.json"
    if not label.exists():
        label.write_text(json.dumps(key, indent=2, sort_keys=True) + "\n")
    return run_dir / f"rank{rank}"
