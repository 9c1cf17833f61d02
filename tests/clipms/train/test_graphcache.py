"""The compile cache keyed by everything a train graph bakes in (clipms.train.graphcache).

On this machine MindSpore's compile cache works on CPU, so the hazard and its fix are shown with
real training runs, each in a process of its own (a cache is read by the next process): one
script, run with lr 5e-3 and then with lr 0.
- unkeyed (MindSpore's cache on in one folder, as the runtime used to set it on Ascend): the
  second run loads the first run's graph and trains with lr 5e-3, whatever its config says;
- keyed (`runtime.compile_cache: true`): the second run compiles its own graph in a folder of
  its own and trains with lr 0 (its loss does not move), and a rerun of the first config finds
  the first folder again.
The key itself is checked as data: each thing baked into the graph changes the folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from clipms.runtime import CACHE_PATH, CACHE_SWITCH, RuntimeConfig
from clipms.train.graphcache import GRAPHS, graph_cache_dir, graph_cache_key
from clipms.train.recipe import TrainConfig
from harness.dvc_workspace import PROJECT_ROOT
from harness.tiny_model import tiny_config

# argv: losses.json lr keyed|unkeyed [unkeyed cache folder]. The script's own text never changes:
# MindSpore's dependency hash covers the entry script, and the lr must reach the graph anyway.
TRAIN = """
import json, os, sys
from clipms.runtime import RuntimeConfig
from clipms.train import loop
from clipms.train.feed import RandomBatches
from clipms.train.loop import TrainConfig, train
from harness.tiny_model import tiny_config
out, lr, mode = sys.argv[1], float(sys.argv[2]), sys.argv[3]
runtime = RuntimeConfig(kernel_fusion=False, compile_cache=mode == "keyed")
if mode == "unkeyed":  # what the runtime did before on Ascend: one cache folder for every run
    def configure_with_one_cache(config, configure=loop.configure):
        settings = configure(config)
        os.environ.update({"MS_COMPILER_CACHE_ENABLE": "1", "MS_COMPILER_CACHE_PATH": sys.argv[4]})
        return settings
    loop.configure = configure_with_one_cache
cfg = TrainConfig(model=tiny_config(vocab_size=100), batch_size=8, lr=lr, warmup_steps=0,
                  max_steps=4, weight_decay=0.0, runtime=runtime)
class OneBatch(RandomBatches):  # the same batch every step: with lr > 0 the loss must fall
    def global_batch(self, epoch, index):
        return super().global_batch(0, 0)
result = train(cfg, OneBatch(cfg.model, 8, 3, seed=1))
json.dump([row["loss"] for row in result.history], open(out, "w"))
"""


def base_config(**update) -> TrainConfig:
    return TrainConfig(**{"model": tiny_config(vocab_size=100), "batch_size": 8, "lr": 1e-3,
                          **update})


def key(cfg: TrainConfig, total: int = 10, world: int = 1) -> dict:
    return graph_cache_key(cfg, total, world, (0.5, 0.5, 0.5), (0.2, 0.2, 0.2))


def test_every_value_a_train_graph_bakes_in_moves_it_to_another_folder(tmp_path):
    cfg = base_config()
    base = graph_cache_dir(tmp_path, key(cfg), rank=0)
    assert base == graph_cache_dir(tmp_path, key(base_config()), rank=0)  # same run, same folder
    others = [
        graph_cache_dir(tmp_path, key(base_config(lr=2e-3)), 0),
        graph_cache_dir(tmp_path, key(base_config(warmup_steps=7)), 0),
        graph_cache_dir(tmp_path, key(base_config(grad_clip_norm=0.5)), 0),
        graph_cache_dir(tmp_path, key(base_config(precision="amp")), 0),
        graph_cache_dir(tmp_path, key(base_config(data_fingerprint="other data")), 0),
        graph_cache_dir(tmp_path, key(base_config(
            runtime=RuntimeConfig(device_target="Ascend"))), 0),
        graph_cache_dir(tmp_path, key(base_config(runtime=RuntimeConfig(jit_level="O1"))), 0),
        graph_cache_dir(tmp_path, key(cfg, total=11), 0),  # total steps: the cosine's length
        graph_cache_dir(tmp_path, key(cfg, world=16), 0),  # 2x8 NPUs average over 16, not 8
        graph_cache_dir(tmp_path, key(cfg), 1),  # each rank its own folder
    ]
    assert len({base, *others}) == 1 + len(others)
    assert base.parent.parent == tmp_path / GRAPHS
    assert json.loads((base.parent / "key.json").read_text())["config"] == cfg.fingerprint()
    # not baked in: cadence settings (how often to log, loader processes) and the cache switch
    same = base_config(log_every=1, workers=7, runtime=RuntimeConfig(compile_cache=True))
    assert graph_cache_dir(tmp_path, key(same), 0) == base


def test_the_key_holds_the_training_codes_digest_not_its_comments(monkeypatch):
    from clipms.train import graphcache

    cfg = base_config()
    before = key(cfg)
    assert before["code"] == graphcache.training_code_digest()
    monkeypatch.setattr(graphcache, "training_code_digest", lambda: "edited step")
    assert key(cfg) != before


def run_training(folder: Path, lr: float, mode: str, unkeyed: Path | None = None) -> list[float]:
    """Losses of the TRAIN script in a fresh interpreter (MindSpore's cache is read at compile)."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder.parent / "train_script.py"
    script.write_text(TRAIN)
    env = {k: v for k, v in os.environ.items() if k not in (CACHE_SWITCH, CACHE_PATH)}
    env.update({"CLIPMS_KERNEL_CACHE": str(folder.parent / "kernels"),
                "PYTHONPATH": str(PROJECT_ROOT)})
    out = folder / "losses.json"
    subprocess.run([sys.executable, str(script), str(out), str(lr), mode,
                    *([str(unkeyed)] if unkeyed else [])], cwd=folder, env=env, check=True,
                   timeout=900, capture_output=True, text=True)
    return json.loads(out.read_text())


@pytest.mark.slow
def test_a_changed_lr_never_meets_the_old_graph_when_the_cache_is_keyed(tmp_path):
    # Unkeyed: MindSpore reuses the lr-5e-3 graph for a run asking for lr 0.
    unkeyed = tmp_path / "unkeyed-cache"
    first = run_training(tmp_path / "u1", 5e-3, "unkeyed", unkeyed)
    stale = run_training(tmp_path / "u2", 0.0, "unkeyed", unkeyed)
    assert first[-1] < first[0]  # lr 5e-3 on one batch: the loss falls
    assert stale == first  # lr 0 asked, lr 5e-3 trained: the old graph
    # Keyed: each config compiles into its own folder; lr 0 trains nothing.
    keyed = run_training(tmp_path / "k1", 5e-3, "keyed")
    frozen = run_training(tmp_path / "k2", 0.0, "keyed")
    np.testing.assert_allclose(keyed, first, rtol=1e-6)  # the same run as the unkeyed first
    assert frozen[0] == keyed[0]  # same weights, same batch before any update
    assert frozen == [frozen[0]] * 4 and keyed[-1] < keyed[0]  # the new lr reached the graph
    folders = sorted((tmp_path / "kernels" / GRAPHS).iterdir())
    assert len(folders) == 2 and all((f / "rank0" / "rank_0" / "graph_cache").is_dir()
                                     for f in folders)
    # A rerun of the first config loads its graph from its folder (written once, not again).
    cached = sorted((tmp_path / "kernels" / GRAPHS).glob("*/rank0/rank_0/graph_cache/*.mindir"))
    written = {path: path.stat().st_mtime_ns for path in cached}
    assert run_training(tmp_path / "k3", 5e-3, "keyed") == keyed
    assert len(list((tmp_path / "kernels" / GRAPHS).iterdir())) == 2
    assert {path: path.stat().st_mtime_ns for path in cached} == written
