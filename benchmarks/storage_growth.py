"""What a night adds to each store on a world that grows a few percent a night, with retention on.

    python benchmarks/storage_growth.py [--images 200 --growth 0.05 --nights 6 --keep-last 1
                                         --prune-remote --workdir WORKDIR
                                         --out benchmarks/results/storage_growth.json]

The world: `--images` learnable pictures (harness/nightly_world.py: a coloured square, circle or
stripe, captions that say which; 64 x 64 JPEGs of about 1 KiB) served over loopback HTTP, listed
by a `metadata.source: local` parquet that grows by `--growth` of the images each night. The
workspace is a copy of the project in its own git repo (harness/dvc_workspace.py: the tiny model of
the test suite, a few training steps a night), its registry a local MLflow store (`mlflow.db`,
artifacts in `mlartifacts/`), its DVC remote a folder, and `retention.keep_last` set to
`--keep-last` in its params.yaml (`retention.prune_remote` to true with `--prune-remote`). Each
night runs `dvc repro -f -s metadata` (the nightly deployment's refresh of the source, which DVC
cannot see change), `dvc repro` (every stage: data, train, evaluate, export, index, register and
the project's own `retain` stage) and `dvc push`.
Before each night after the first, the search-index store's marks that the last `retain`
recorded (`models/index-store-listing.json`: the chunks no reference named then) are made a day
older: nights here are minutes apart, and `retain` removes an unreferenced index chunk only when
marks at least `registry.retention.LISTING_MIN_AGE_S` old name it, which a real night's gap always
is. Then it measures:

- the night's new image bytes: the JPEG bytes of the samples the shards hold tonight and did not
  hold last night;
- each store's NET growth over the night (the DVC cache `.dvc/cache`, the DVC remote, the MLflow
  artifact store), what the night wrote to it and what retention freed from it (files gone);
- one version's model files (the export bundle and the training checkpoint, as `register` logs
  them), and the bound the stores are held to: twice the new image bytes plus those files. The
  search index is not counted in them: a retrained model embeds every image again, so each
  version has its own index, and retention replaces an old one as it comes;
- what `retain` kept whole, removed and freed (metrics/retain.json);
- what the shard stage kept and wrote, and what `register` uploaded of the search index;
- what each store's new and freed files are: DVC's by the output holding a file of that md5,
  MLflow's by where they lie (bundle, checkpoint, the pyfunc's copy of the code, index chunks,
  plots).

The DVC remote is the backup retention relies on (an object leaves the local cache only once the
remote holds it), so by default nothing is removed from it: it keeps every version and grows with
them. With `--prune-remote` retention also removes from it what it removed from the cache
(`retention.prune_remote`), and the run is written to storage_growth_prune_remote.json.

The JSON (benchmarks/record.py's envelope) holds every night; benchmarks/RESULTS.md renders it
("Storage per night").
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


def params(source_path: Path, keep_last: int = 1, prune_remote: bool = False
           ) -> dict[str, Any]:
    """The overrides of the test suite's tiny params (harness/dvc_workspace.py) for a nightly
    world."""
    return {
        "metadata.source": "local", "metadata.path": str(source_path),
        "download.allow_private_addresses": True, "download.samples_per_shard": 16,
        "evaluate.zeroshot.source": "none",  # the local source has no labels
        "changes.min_new": 1,
        "train.max_steps": 4, "train.checkpoint_every": 100, "export.batch_sizes": [1, 8],
        "register.model_name": MODEL, "register.primary_metric": "i2t_R@5",
        "retention.enabled": True, "retention.keep_last": keep_last,
        "retention.prune_remote": prune_remote,
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


def files_of(ws: Path) -> dict[str, dict[Path, int]]:
    """Per store, its files and their bytes."""
    return {name: {p: p.stat().st_size for p in (ws / folder).rglob("*") if p.is_file()}
            for name, folder in STORE_FOLDERS.items() if (ws / folder).exists()}


def changes(earlier: dict[str, dict[Path, int]], later: dict[str, dict[Path, int]]
            ) -> tuple[dict[str, dict[Path, int]], dict[str, dict[Path, int]]]:
    """Per store, the files written since `earlier` (new, or of another size) and those gone."""
    written = {name: {p: size for p, size in files.items()
                      if earlier.get(name, {}).get(p) != size}
               for name, files in later.items()}
    gone = {name: {p: size for p, size in files.items() if p not in later.get(name, {})}
            for name, files in earlier.items()}
    return written, gone


def age_index_listing(ws: Path, seconds: float = 24 * 3600) -> bool:
    """Make the search-index store's marks that `retain` recorded `seconds` older, as if the
    next night came a day later (False when none was recorded)."""
    from registry.retention import LISTING_FILE

    path = ws / LISTING_FILE
    if not path.exists():
        return False
    listings = json.loads(path.read_text())
    for entry in listings.values():
        entry["listed_at"] = float(entry["listed_at"]) - seconds
    path.write_text(json.dumps(listings))
    return True


def dvc_owner(ws: Path, owners: dict[str, str] | None = None) -> dict[str, str]:
    """md5 -> the DVC output holding a file of that content (as DVC names cache files), added to
    `owners` (what earlier nights' workspaces held: the owners of what retention frees)."""
    owners = {} if owners is None else owners
    for top in ("data", "models", "plots"):
        for path in (ws / top).rglob("*") if (ws / top).exists() else ():
            if path.is_file():
                parts = path.relative_to(ws).parts
                owners[hashlib.md5(path.read_bytes()).hexdigest()] = "/".join(parts[:2])
    return owners


def breakdown(owners: dict[str, str], files: dict[str, dict[Path, int]]
              ) -> dict[str, dict[str, int]]:
    """Per store, the bytes of `files` by what they are."""
    out: dict[str, dict[str, int]] = {}
    for name, paths in files.items():
        groups: dict[str, int] = {}
        for path, size in paths.items():
            text = path.as_posix()
            if name == "mlflow_artifacts":
                group = next((g for part, g in MLFLOW_PARTS if part in text), "other")
            else:
                md5 = path.parent.name + path.name.removesuffix(".dir")
                group = ("directory listings" if path.name.endswith(".dir")
                         else owners.get(md5, "other"))
            groups[group] = groups.get(group, 0) + size
        out[name] = dict(sorted(groups.items(), key=lambda kv: -kv[1]))
    return out


def retained(ws: Path) -> dict[str, Any]:
    """What tonight's `retain` stage kept, removed and freed (metrics/retain.json)."""
    path = ws / "metrics/retain.json"
    report = json.loads(path.read_text()) if path.exists() else {}
    return {"kept": sorted(report.get("kept", {})), "removed": sorted(report.get("removed", {})),
            **{key: report.get(key, 0) for key in ("mlflow_bytes", "index_chunk_bytes",
                                                   "dvc_cache_bytes", "dvc_remote_bytes")}}


def night(ws: Path, env: dict[str, str], held: dict[str, int],
          earlier: dict[str, dict[Path, int]], owners: dict[str, str]
          ) -> tuple[dict[str, Any], dict[str, int], dict[str, dict[Path, int]]]:
    from harness.dvc_workspace import run

    aged = age_index_listing(ws)  # a day passes between two nights
    started = time.perf_counter()
    # As the nightly deployment does (`refresh: [metadata]`): the source is outside DVC's view.
    run(["dvc", "repro", "-f", "-s", "metadata"], ws, timeout=600, env=env)
    run(["dvc", "repro"], ws, timeout=7200, env=env)  # the retain stage last
    repro_s = time.perf_counter() - started
    run(["dvc", "push"], ws, timeout=1800, env=env)
    images = shard_images(ws)
    new = {k: v for k, v in images.items() if k not in held}
    later = files_of(ws)
    written, gone = changes(earlier, later)
    dvc_owner(ws, owners)
    shard = json.loads((ws / "metrics/shard.json").read_text())
    register = json.loads((ws / "metrics/register.json").read_text())
    bound_files = model_files(ws)
    row: dict[str, Any] = {
        "images": len(images), "new_images": len(new), "new_image_bytes": sum(new.values()),
        "model_files_bytes": bound_files, "repro_s": round(repro_s, 1),
        "index_listing_aged": aged,
        "shards_bytes": folder_bytes(ws / "data/shards"),
        "shards_kept": sum(shard[s]["shards_kept"] for s in ("train", "val")),
        "shards_new": sum(shard[s]["shards_new"] for s in ("train", "val")),
        "shard_rewrite": shard["rewrite"],
        "index_bytes": register.get("index_bytes"),
        "index_added_bytes": register.get("index_added_bytes"),
        "version": register["version"], "alias": register["alias"],
        "retain": retained(ws),
        "totals": {name: sum(files.values()) for name, files in later.items()},
        "added_by_kind": breakdown(owners, written),
        "freed_by_kind": breakdown(owners, gone),
    }
    bound = 2 * row["new_image_bytes"] + bound_files
    for name in STORE_FOLDERS:
        after = row["totals"].get(name, 0)
        row[f"{name}_added"] = after - sum(earlier.get(name, {}).values())  # net: written - freed
        row[f"{name}_written"] = sum(written.get(name, {}).values())
        row[f"{name}_freed"] = sum(gone.get(name, {}).values())
        row[f"{name}_within_bound"] = row[f"{name}_added"] <= bound
    row["bound_bytes"] = bound
    return row, images, later


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=200, help="images on the first night")
    parser.add_argument("--growth", type=float, default=0.05, help="added each night (share)")
    parser.add_argument("--nights", type=int, default=6)
    parser.add_argument("--keep-last", type=int, default=1,
                        help="retention.keep_last in the workspace's params.yaml")
    parser.add_argument("--prune-remote", action="store_true",
                        help="retention.prune_remote: true (written to "
                        "storage_growth_prune_remote.json by default)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the workspace goes (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.out is None:
        args.out = record.default_path(name(args.prune_remote))
    return args


def name(prune_remote: bool) -> str:
    """The result's name: one file per retention setting of the remote."""
    return "storage_growth_prune_remote" if prune_remote else "storage_growth"


def main() -> None:
    args = _parse()
    if (args.images < 20 or not 0 < args.growth <= 1 or args.nights < 2
            or args.keep_last < 0):
        raise SystemExit("expected --images >= 20, 0 < --growth <= 1, --nights >= 2 and "
                         "--keep-last >= 0")
    from harness.dvc_workspace import make_workspace, tool_env
    from harness.nightly_world import GrowingSource, shape_captions, shape_picture

    recording = record.Recording(name(args.prune_remote), record.shown_command(
        record.with_placeholders([sys.executable, *sys.argv], {"--workdir": "WORKDIR"})))
    step = max(1, round(args.images * args.growth))
    counts = [args.images + n * step for n in range(args.nights)]
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="clipms-storage-",
                                     dir=args.workdir) as tmp:
        root = Path(tmp)
        source = GrowingSource(root / "source", capacity=counts[-1], draw=shape_picture)
        ws = make_workspace(root / "ws", params(source.path, args.keep_last, args.prune_remote))
        env = {**tool_env(), "MLFLOW_TRACKING_URI": f"sqlite:///{ws}/mlflow.db"}
        nights: list[dict[str, Any]] = []
        held: dict[str, int] = {}
        before: dict[str, dict[Path, int]] = {}
        owners: dict[str, str] = {}
        with source.site() as site:
            for number, count in enumerate(counts, start=1):
                source.write(site, range(count), captions=shape_captions)
                row, held, before = night(ws, env, held, before, owners)
                nights.append({"night": number, **row})
                print(json.dumps(nights[-1]), flush=True)
                recording.write({"images": args.images, "growth": args.growth,
                                 "keep_last": args.keep_last,
                                 "prune_remote": args.prune_remote, "nights": nights},
                                args.out)  # a killed run keeps its nights
    print(f"wrote {record.shown_path(str(args.out))}")


if __name__ == "__main__":
    os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
    main()
