"""A night with new images against a full run: download + shard time (commands, not tests).

    python benchmarks/bench_incremental.py [--images 10000 --growth 0.1 --rounds 2
                                            --out benchmarks/results/incremental_download.json]

The world: `--images` of the synthetic source's pictures (prep.synthetic, 128 px PNGs,
five captions each), grown by `--growth` (the generator draws each image from its own seed, so the
grown world holds the same first images), served over loopback HTTP by `python -m http.server`
in its own process, deduped by the dedupe stage into images.parquet. Each round runs, in this
order:

- full: a new workspace, the grown world's images.parquet: `python -m stages.download`, then
  `python -m stages.shard`;
- incremental: a workspace whose download store (and shard checks) hold the base world, as the
  night before left them (copied in, not timed): the same two commands on the grown world.

Both start the stages as DVC does (a process each, imports included) and time them wall-clock,
and count their CPU seconds (the stage's and every process it waited for: img2dataset's workers).
Rounds alternate the two; the JSON (benchmarks/record.py's envelope, by default
benchmarks/results/incremental_download.json) holds every run, the medians and the ratios
(incremental / full), with the load average before and after each run: the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import record  # noqa: E402 - benchmarks/record.py

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")  # img2dataset imports albumentations

PARAMS = {
    "metadata": {"source": "local", "path": "unused"},
    "dedupe": {"keep": "all", "min_caption_chars": 5, "val_fraction": 0.1},
    "download": {"image_size": 128, "resize_mode": "center_crop", "encode_quality": 95,
                 "processes": 2, "threads": 16, "timeout": 10, "retries": 1,
                 "samples_per_shard": 1000, "allowed_schemes": ["http", "https"],
                 "allow_private_addresses": True, "min_success_rate": 0.5},
    "shard": {"samples_per_shard": 512, "min_image_size": 32, "seed": 0, "workers": 2},
}


def load() -> float:
    return round(os.getloadavg()[0], 2)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_world(folder: Path, images: int, growth: float) -> tuple[Path, list]:
    """The grown world's PNGs in `folder/site`; (that folder, their records)."""
    from prep import synthetic

    site = folder / "site"
    site.mkdir(parents=True)
    return site, synthetic.generate(site, round(images * (1 + growth)), 128, seed=0)


def metadata(records: list, base_url: str, out: Path) -> None:
    """A metadata.parquet of these images, as the metadata stage writes it."""
    import pyarrow as pa

    from prep.sources import SCHEMA, write_table

    urls, texts = [], []
    for image in records:
        for caption in image.captions:
            urls.append(f"{base_url}/{image.file_name}")
            texts.append(caption)
    nulls = [None] * len(urls)
    write_table(pa.table({"URL": urls, "TEXT": texts, "LABELS": nulls, "ID": nulls,
                          "SPLIT": nulls}, schema=SCHEMA), out)


def workspace(folder: Path, metadata_file: Path) -> Path:
    """A folder with params.yaml and data/images.parquet deduped from `metadata_file`."""
    (folder / "data").mkdir(parents=True)
    (folder / "params.yaml").write_text(yaml.safe_dump(PARAMS))
    shutil.copy(metadata_file, folder / "data/metadata.parquet")
    stage(folder, "dedupe")
    return folder


def stage(folder: Path, name: str) -> float:
    return stage_times(folder, name)[0]


def stage_times(folder: Path, name: str) -> tuple[float, float]:
    """Wall seconds, and CPU seconds (user + system) of the stage and every process it waited
    for (img2dataset's workers, the shard stage's): CPU time says what the work costs when the
    machine is shared and wall time says how long the night took."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cpu_before = _children_cpu()
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", f"stages.{name}"], cwd=folder, env=env,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if proc.returncode:
        raise RuntimeError(f"{name} failed in {folder}:\n{proc.stdout[-3000:]}\n{proc.stderr}")
    return round(seconds, 2), round(_children_cpu() - cpu_before, 2)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed_night(folder: Path) -> dict[str, object]:
    before = load()
    download, download_cpu = stage_times(folder, "download")
    shard, shard_cpu = stage_times(folder, "shard")
    metrics = json.loads((folder / "metrics/download.json").read_text())
    return {"download_s": download, "shard_s": shard, "total_s": round(download + shard, 2),
            "download_cpu_s": download_cpu, "shard_cpu_s": shard_cpu,
            "total_cpu_s": round(download_cpu + shard_cpu, 2),
            "fetched": metrics["attempted"], "reused": metrics["reused_images"],
            "samples": json.loads((folder / "metrics/shard.json").read_text())["samples_out"],
            "load_before": before, "load_after": load()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=10000)
    parser.add_argument("--growth", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/"
                        "incremental_download.json")
    args = parser.parse_args()
    recording = record.start("incremental_download")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the server, remove the scratch
    scratch = Path(tempfile.mkdtemp(prefix="bench-incremental-"))
    port = free_port()
    server = None
    try:
        site, records = make_world(scratch, args.images, args.growth)
        base, grown = args.images, len(records)
        server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind",
                                   "127.0.0.1", "--directory", str(site)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(2)
        url = f"http://127.0.0.1:{port}"
        metadata(records[:base], url, scratch / "base.parquet")
        metadata(records, url, scratch / "grown.parquet")
        night_before = workspace(scratch / "night-before", scratch / "base.parquet")
        prepared = {f"{name}_{unit}": value for name in ("download", "shard")
                    for unit, value in zip(("s", "cpu_s"), stage_times(night_before, name),
                                           strict=True)}
        runs: list[dict[str, object]] = []
        for index in range(args.rounds):
            for kind in ("full", "incremental"):
                folder = workspace(scratch / f"{kind}-{index}", scratch / "grown.parquet")
                if kind == "incremental":  # what the night before left (DVC's persist outs)
                    for keep in ("data/download", "data/shard-checks"):
                        if (night_before / keep).exists():
                            shutil.copytree(night_before / keep, folder / keep)
                runs.append({"kind": kind, "round": index, **timed_night(folder)})
                print(json.dumps(runs[-1]), flush=True)
                shutil.rmtree(folder)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
        shutil.rmtree(scratch, ignore_errors=True)
    result = summarise(args, base, grown, prepared, runs)
    print(json.dumps(result["summary"], indent=2))
    print(recording.write(result, args.out))
    return 0


def summarise(args: argparse.Namespace, base: int, grown: int, prepared: dict,
              runs: list[dict[str, object]]) -> dict[str, object]:
    def median(kind: str, key: str) -> float:
        return round(statistics.median(float(r[key]) for r in runs if r["kind"] == kind), 2)

    def ratios(key: str) -> list[float]:
        return [round(float(i[key]) / float(f[key]), 3)
                for f, i in zip(runs[0::2], runs[1::2], strict=True)]

    summary = {
        "base_images": base, "grown_images": grown,
        "full_total_s_median": median("full", "total_s"),
        "incremental_total_s_median": median("incremental", "total_s"),
        "ratio_per_round": ratios("total_s"),
        "ratio_median": round(median("incremental", "total_s") / median("full", "total_s"), 3),
        "full_total_cpu_s_median": median("full", "total_cpu_s"),
        "incremental_total_cpu_s_median": median("incremental", "total_cpu_s"),
        "cpu_ratio_per_round": ratios("total_cpu_s"),
        "cpu_ratio_median": round(median("incremental", "total_cpu_s")
                                  / median("full", "total_cpu_s"), 3),
        "full_download_s_median": median("full", "download_s"),
        "full_shard_s_median": median("full", "shard_s"),
        "incremental_download_s_median": median("incremental", "download_s"),
        "incremental_shard_s_median": median("incremental", "shard_s"),
    }
    return {"params": PARAMS, "growth": args.growth, "night_before": prepared, "runs": runs,
            "summary": summary}


if __name__ == "__main__":
    sys.exit(main())
