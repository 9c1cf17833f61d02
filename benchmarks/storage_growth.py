"""What a night adds to each store on a world that grows a few percent a night.

    python benchmarks/storage_growth.py [--images 200 --growth 0.05 --nights 4
                                         --workdir WORKDIR
                                         --out benchmarks/results/storage_growth.json]

The world: `--images` learnable pictures (harness/nightly_world.py: a coloured square, circle or
stripe, captions that say which) served over loopback HTTP, listed by a `metadata.source: local`
parquet that grows by `--growth` of the images each night. The workspace is a copy of the project
in its own git repo (harness/dvc_workspace.py: the tiny model of the test suite, a few training
steps a night), its registry a local MLflow store (`mlflow.db`, artifacts in `mlartifacts/`), its
DVC remote a folder. Each night runs `dvc repro -f -s metadata` (the nightly deployment's refresh of
the source, which DVC cannot see change), `dvc repro` (every stage: data, train, evaluate,
export, index, register) and `dvc push`, then measures:

- the night's new image bytes: the JPEG bytes of the samples the shards hold tonight and did not
  hold last night;
- the growth of the DVC cache (`.dvc/cache`), the DVC remote and the MLflow artifact store;
- one version's model files (the export bundle and the training checkpoint, as `register` logs
  them), and the bound the stores are held to: twice the new image bytes plus those files;
- what the shard stage kept and wrote, and what `register` uploaded of the search index;
- what each store's new files are: DVC's by the output holding a file of that md5, MLflow's by
  where they lie (bundle, checkpoint, the pyfunc's copy of the code, index chunks, plots).

The JSON (benchmarks/record.py's envelope) holds every night; benchmarks/RESULTS.md renders it
("Storage per night"). No retention runs here, so what stays in the stores for good is read
from the growth of one night, not from the totals.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import record  # noqa: E402 - benchmarks/record.py

MODEL = "clip-growth"


def params(source_path: Path) -> dict[str, Any]:
    """The overrides of the test suite's tiny params (harness/dvc_workspace.py) for a nightly
    world."""
    return {
        "metadata.source": "local", "metadata.path": str(source_path),
        "download.allow_private_addresses": True, "download.samples_per_shard": 16,
        "evaluate.zeroshot.source": "none",  # the local source has no labels
        "changes.min_new": 1,
        "train.max_steps": 4, "train.checkpoint_every": 100, "export.batch_sizes": [1, 8],
        "register.model_name": MODEL, "register.primary_metric": "i2t_R@5",
    }


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def shard_images(ws: Path) -> dict[str, int]:
    """key -> JPEG bytes of every sample the workspace's shards hold (excluded ones left out)."""
    from clipms.data import webds

    return {s.key: len(s.files["jpg"]) for split in ("train", "val")
            for s in webds.iter_split(ws / "data/shards", split)}


def model_files(ws: Path) -> int:
    """One version's model files: the export bundle and the checkpoint it was exported from."""
    return folder_bytes(ws / "models/export") + sum(
        (ws / "models" / name).stat().st_size for name in ("clip.ckpt", "clip.json",
                                                           "tokenizer.json"))


STORE_FOLDERS = {"dvc_cache": ".dvc/cache", "dvc_remote": "dvc-remote",
                 "mlflow_artifacts": "mlartifacts"}
# What an MLflow artifact is, by where it lies (registry/registration.py, registry/pyfunc.py).
MLFLOW_PARTS = (("/artifacts/code/", "pyfunc code copy"), ("/artifacts/artifacts/", "bundle"),
                ("/checkpoint/", "checkpoint"), ("/chunks/", "index chunks"),
                ("/plots/", "plots"))


def stores(ws: Path) -> dict[str, int]:
    return {name: folder_bytes(ws / folder) for name, folder in STORE_FOLDERS.items()}


def files_of(ws: Path) -> dict[str, set[Path]]:
    return {name: {p for p in (ws / folder).rglob("*") if p.is_file()}
            for name, folder in STORE_FOLDERS.items() if (ws / folder).exists()}


def dvc_owner(ws: Path) -> dict[str, str]:
    """md5 -> the DVC output holding a file of that content (as DVC names cache files)."""
    owners: dict[str, str] = {}
    for top in ("data", "models", "plots"):
        for path in (ws / top).rglob("*") if (ws / top).exists() else ():
            if path.is_file():
                parts = path.relative_to(ws).parts
                owners[hashlib.md5(path.read_bytes()).hexdigest()] = "/".join(parts[:2])
    return owners


def breakdown(ws: Path, new: dict[str, set[Path]]) -> dict[str, dict[str, int]]:
    """Per store, the bytes of its new files by what they are."""
    owners = dvc_owner(ws)
    out: dict[str, dict[str, int]] = {}
    for name, paths in new.items():
        groups: dict[str, int] = {}
        for path in paths:
            text = path.as_posix()
            if name == "mlflow_artifacts":
                group = next((g for part, g in MLFLOW_PARTS if part in text), "other")
            else:
                md5 = path.parent.name + path.name.removesuffix(".dir")
                group = ("directory listings" if path.name.endswith(".dir")
                         else owners.get(md5, "other"))
            groups[group] = groups.get(group, 0) + path.stat().st_size
        out[name] = dict(sorted(groups.items(), key=lambda kv: -kv[1]))
    return out


def night(ws: Path, env: dict[str, str], held: dict[str, int],
          before: dict[str, int]) -> tuple[dict[str, Any], dict[str, int], dict[str, int]]:
    from harness.dvc_workspace import run

    earlier = files_of(ws)
    started = time.perf_counter()
    # As the nightly deployment does (`refresh: [metadata]`): the source is outside DVC's view.
    run(["dvc", "repro", "-f", "-s", "metadata"], ws, timeout=600, env=env)
    run(["dvc", "repro"], ws, timeout=7200, env=env)
    repro_s = time.perf_counter() - started
    run(["dvc", "push"], ws, timeout=1800, env=env)
    images = shard_images(ws)
    new = {k: v for k, v in images.items() if k not in held}
    after = stores(ws)
    shard = json.loads((ws / "metrics/shard.json").read_text())
    register = json.loads((ws / "metrics/register.json").read_text())
    bound_files = model_files(ws)
    row: dict[str, Any] = {
        "images": len(images), "new_images": len(new), "new_image_bytes": sum(new.values()),
        "model_files_bytes": bound_files, "repro_s": round(repro_s, 1),
        "shards_bytes": folder_bytes(ws / "data/shards"),
        "shards_kept": sum(shard[s]["shards_kept"] for s in ("train", "val")),
        "shards_new": sum(shard[s]["shards_new"] for s in ("train", "val")),
        "shard_rewrite": shard["rewrite"],
        "index_bytes": register.get("index_bytes"),
        "index_added_bytes": register.get("index_added_bytes"),
        "version": register["version"], "alias": register["alias"],
        "totals": after,
        "added_by_kind": breakdown(ws, {name: paths - earlier.get(name, set())
                                        for name, paths in files_of(ws).items()}),
    }
    bound = 2 * row["new_image_bytes"] + bound_files
    for name, total in after.items():
        row[f"{name}_added"] = total - before.get(name, 0)
        row[f"{name}_within_bound"] = row[f"{name}_added"] <= bound
    row["bound_bytes"] = bound
    return row, images, after


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=200, help="images on the first night")
    parser.add_argument("--growth", type=float, default=0.05, help="added each night (share)")
    parser.add_argument("--nights", type=int, default=4)
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the workspace goes (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=record.default_path("storage_growth"))
    return parser.parse_args()


def main() -> None:
    args = _parse()
    if args.images < 20 or not 0 < args.growth <= 1 or args.nights < 2:
        raise SystemExit("expected --images >= 20, 0 < --growth <= 1 and --nights >= 2")
    from harness.dvc_workspace import make_workspace, tool_env
    from harness.nightly_world import GrowingSource, shape_captions, shape_picture

    recording = record.Recording("storage_growth", record.shown_command(
        record.with_placeholders([sys.executable, *sys.argv], {"--workdir": "WORKDIR"})))
    step = max(1, round(args.images * args.growth))
    counts = [args.images + n * step for n in range(args.nights)]
    with tempfile.TemporaryDirectory(prefix="clipms-storage-",
                                     dir=args.workdir) as tmp:
        root = Path(tmp)
        source = GrowingSource(root / "source", capacity=counts[-1], draw=shape_picture)
        ws = make_workspace(root / "ws", params(source.path))
        env = {**tool_env(), "MLFLOW_TRACKING_URI": f"sqlite:///{ws}/mlflow.db"}
        nights: list[dict[str, Any]] = []
        held: dict[str, int] = {}
        before: dict[str, int] = {}
        with source.site() as site:
            for number, count in enumerate(counts, start=1):
                source.write(site, range(count), captions=shape_captions)
                row, held, before = night(ws, env, held, before)
                nights.append({"night": number, **row})
                print(json.dumps(nights[-1]), flush=True)
                recording.write({"images": args.images, "growth": args.growth,
                                 "nights": nights}, args.out)  # a killed run keeps its nights
    print(f"wrote {record.shown_path(str(args.out))}")


if __name__ == "__main__":
    os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
    main()
