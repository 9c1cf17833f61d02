"""Benchmarks of the data stages (commands, not tests). Figures go to benchmarks/RESULTS.md.

    python benchmarks/bench_data.py dedupe   [--images 120000 --captions 5]
    python benchmarks/bench_data.py shard    [--samples 4000 --image-size 256]
    python benchmarks/bench_data.py download [--images 2500 --shards 5 --processes 2 --threads 16
                                              --distributor multiprocessing|pyspark|ray]
    python benchmarks/bench_data.py urlguard [--requests 300 --rounds 5]

Each prints one line of JSON with the measured figures and records it, with the commit, the
machine and its load (benchmarks/record.py), in benchmarks/results/data_<name>.json (`--results` for
another path). Inputs are generated in a temporary folder that is removed afterwards.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import sys
import tempfile
import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import record  # noqa: E402 - benchmarks/record.py, beside this script

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")  # img2dataset imports albumentations

WORDS = (
    "a", "an", "the", "man", "woman", "dog", "cat", "bus", "train", "plate", "pizza", "table",
    "street", "kite", "sky", "red", "blue", "green", "small", "large", "two", "three",
    "sitting", "standing", "next", "to", "on", "of", "with", "near", "holding", "riding",
    "parked", "white", "black", "wooden", "old", "young", "people", "group", "field", "water",
    "tree", "building", "road", "car"
)


def mscoco_like(images: int, captions: int, seed: int = 0) -> pd.DataFrame:
    """~MSCOCO-shaped metadata: `captions` per image, with exact and near duplicates."""
    rng = np.random.default_rng(seed)
    n = images * captions
    lengths = rng.integers(8, 15, size=n)
    words = np.array(WORDS)[rng.integers(0, len(WORDS), size=int(lengths.sum()))]
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    text = [" ".join(words[bounds[i]:bounds[i + 1]]) for i in range(n)]
    text = [t.capitalize() + "." for t in text]
    ids = rng.choice(600_000, size=images, replace=False)
    urls = np.repeat([f"http://images.cocodataset.org/train2017/{i:012d}.jpg" for i in ids],
                     captions)
    frame = pd.DataFrame({"URL": urls, "TEXT": text})
    first = frame.index[::captions]
    exact = rng.choice(first, size=images // 20, replace=False)        # 5% exact duplicate rows
    near = rng.choice(first, size=images // 10, replace=False)         # 10% near duplicates
    extra = pd.concat([
        frame.loc[exact],
        frame.loc[near].assign(TEXT=lambda f: f.TEXT.str.upper().str.rstrip(".") + " !"),
    ])
    return pd.concat([frame, extra], ignore_index=True).sample(frac=1.0, random_state=seed)


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (worker pools): on a shared machine
    wall time mostly measures the other tenants, CPU time measures the work."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def bench_dedupe(args: argparse.Namespace) -> dict:
    from prep.captions import dedupe, read_metadata, write_images

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "metadata.parquet"
        mscoco_like(args.images, args.captions).to_parquet(path, index=False)
        started, cpu = time.perf_counter(), cpu_seconds()
        result = dedupe(read_metadata(path), {"http", "https"}, log=lambda _m: None)
        write_images(result.images, Path(tmp) / "images.parquet")
        seconds, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    return {"bench": "dedupe", "rows_in": result.stats["rows_in"],
            "images_out": result.stats["images_out"], "seconds": round(seconds, 2),
            "cpu_seconds": round(cpu, 2),
            "removed": result.stats["removed"]}


def _jpeg(rng: np.random.Generator, size: int) -> bytes:
    """A photo-like JPEG (smooth gradients + noise), ~10-20 KB at 256 px."""
    from PIL import Image

    yy, xx = np.mgrid[0:size, 0:size] / size
    base = np.stack([xx * rng.uniform(50, 255), yy * rng.uniform(50, 255),
                     (xx + yy) * rng.uniform(20, 120)], axis=-1)
    noisy = base + rng.normal(0, 12, size=base.shape)
    out = io.BytesIO()
    Image.fromarray(noisy.clip(0, 255).astype(np.uint8)).save(out, format="JPEG", quality=90)
    return out.getvalue()


def write_download_like(folder: Path, samples: int, per_tar: int, size: int) -> None:
    """Tars shaped like img2dataset's output (jpg/txt/json with captions, split, image_key)."""
    import webdataset as wds

    rng = np.random.default_rng(0)
    pool = [_jpeg(rng, size) for _ in range(64)]  # distinct images are not what is measured
    for shard in range(-(-samples // per_tar)):
        with wds.TarWriter(str(folder / f"{shard:05d}.tar")) as sink:
            for i in range(shard * per_tar, min(samples, (shard + 1) * per_tar)):
                meta = {"captions": [f"caption {i}", f"another caption {i}"],
                        "split": "val" if i % 10 == 0 else "train", "image_key": f"{i:016x}",
                        "url": f"http://x/{i}.jpg", "labels": None}
                sink.write({"__key__": f"{i:09d}", "jpg": pool[i % len(pool)],
                            "txt": meta["captions"][0], "json": json.dumps(meta)})


def bench_shard(args: argparse.Namespace) -> dict:
    from prep.shards import ShardSettings, build_shards

    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "download", Path(tmp) / "shards"
        src.mkdir()
        write_download_like(src, args.samples, args.per_tar, args.image_size)
        settings = ShardSettings(samples_per_shard=512, min_image_size=32, seed=0,
                                 workers=args.workers)
        started, cpu = time.perf_counter(), cpu_seconds()
        metrics = build_shards(src, dst, settings, print_fn=lambda _m: None)
        seconds, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    samples = metrics["samples_out"]
    return {"bench": "shard", "samples": samples, "workers": args.workers,
            "seconds": round(seconds, 2), "samples_per_s": round(samples / seconds),
            "cpu_seconds": round(cpu, 2), "samples_per_cpu_s": round(samples / cpu)}


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *_args) -> None:
        pass


def bench_download(args: argparse.Namespace) -> dict:
    from prep.engines import EngineSettings
    from prep.fetch import DownloadSettings, download_images
    from prep.urlguard import FetchPolicy

    with tempfile.TemporaryDirectory() as tmp:
        www = Path(tmp) / "www"
        www.mkdir()
        rng = np.random.default_rng(0)
        for i in range(64):
            (www / f"{i}.jpg").write_bytes(_jpeg(rng, args.source_size))
        server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Quiet, directory=str(www)))
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            port = server.server_address[1]
            urls = [f"http://127.0.0.1:{port}/{i % 64}.jpg?n={i}" for i in range(args.images)]
            images = pd.DataFrame({"url": urls, "key": [f"{i:016x}" for i in range(len(urls))],
                                   "caption": "a caption", "captions": [["a caption"]] * len(urls),
                                   "split": "train", "labels": None})
            images_file = Path(tmp) / "images.parquet"
            images.to_parquet(images_file, index=False)
            settings = DownloadSettings(image_size=256, timeout=10, retries=0,
                                        samples_per_shard=-(-args.images // args.shards))
            engine = EngineSettings(distributor=args.distributor, processes=args.processes,
                                    threads=args.threads)
            # the server is on loopback: allowed explicitly (the pipeline's default refuses it)
            policy = FetchPolicy(frozenset({"http"}), allow_private_addresses=True)
            cpu = cpu_seconds()
            metrics = download_images(images_file, Path(tmp) / "out", settings, engine, policy,
                                      print_fn=lambda _m: None)
            cpu = cpu_seconds() - cpu
        finally:
            server.shutdown()
            server.server_close()
    return {"bench": "download", "images": args.images, "successes": metrics["successes"],
            "shards": args.shards, "distributor": args.distributor,
            "processes": args.processes, "threads": args.threads,
            "seconds": metrics["seconds"],
            "images_per_s": round(metrics["successes"] / metrics["seconds"]),
            "cpu_seconds_incl_server": round(cpu, 2)}


def bench_urlguard(args: argparse.Namespace) -> dict:
    """Requests/s through urllib's default opener and through the URL policy's opener
    (prep.urlguard, address checks on), alternated in rounds against one loopback server."""
    import urllib.request

    from prep.urlguard import FetchPolicy, build_opener

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "0.jpg").write_bytes(_jpeg(np.random.default_rng(0), args.source_size))
        server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Quiet, directory=tmp))
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}/0.jpg"
        openers = {"urllib": urllib.request.build_opener(),
                   "guarded": build_opener(FetchPolicy(allowed_networks=("127.0.0.1/32",)))}
        rates: dict[str, list[float]] = {name: [] for name in openers}
        try:
            for _ in range(args.rounds):
                for name, opener in openers.items():
                    started = time.perf_counter()
                    for _ in range(args.requests):
                        with opener.open(url, timeout=10) as response:
                            response.read()
                    rates[name].append(args.requests / (time.perf_counter() - started))
        finally:
            server.shutdown()
            server.server_close()
    median = {name: round(float(np.median(r)), 1) for name, r in rates.items()}
    return {"bench": "urlguard", "requests_per_round": args.requests, "rounds": args.rounds,
            "requests_per_s": median, "guarded_over_urllib": round(
                median["guarded"] / median["urllib"], 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="bench", required=True)
    p = sub.add_parser("dedupe", help="dedupe on generated MSCOCO-sized metadata")
    p.add_argument("--images", type=int, default=120_000)
    p.add_argument("--captions", type=int, default=5)
    p = sub.add_parser("shard", help="shard validation + writing, samples/s")
    p.add_argument("--samples", type=int, default=4000)
    p.add_argument("--per-tar", type=int, default=1000)
    p.add_argument("--image-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=2)
    p = sub.add_parser("download", help="img2dataset against a loopback HTTP server, images/s")
    p.add_argument("--images", type=int, default=2500)
    p.add_argument("--shards", type=int, default=5)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--source-size", type=int, default=320)
    p.add_argument("--distributor", choices=("multiprocessing", "pyspark", "ray"),
                   default="multiprocessing", help="img2dataset's distributor (pyspark: local)")
    p = sub.add_parser("urlguard", help="requests/s: urllib's opener vs the URL policy's")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--source-size", type=int, default=256)
    for p in sub.choices.values():
        p.add_argument("--results", type=Path, help="result file (default: "
                       "benchmarks/results/data_<name>.json)")
    args = parser.parse_args(argv)
    recording = record.start(f"data_{args.bench}", sys.argv if argv is None else
                             ["benchmarks/bench_data.py", *argv])
    result = {"dedupe": bench_dedupe, "shard": bench_shard, "download": bench_download,
              "urlguard": bench_urlguard}[
        args.bench](args)
    result["load_avg_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result))
    recording.write(result, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
