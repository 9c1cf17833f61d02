"""clipms against open_clip on this CPU: the training step and the MindIR encoders, alternated.

    python benchmarks/speed_vs_openclip.py --peer-python ~/venvs/openclip/bin/python --rounds 2

For each work (`train`: forward + loss + backward + AdamW; `encode`: the image and the text tower)
three commands run once per round, in an order that rotates each round (benchmarks/record.py,
`alternate`): `python -m benchmarks.throughput` with CPU kernel fusion (the default), the same with
`--kernel-fusion off`, and benchmarks/openclip_peer.py in the peer's virtualenv (open_clip on
PyTorch, the same architecture from the same preset, the same random inputs and timer). `encode`
times the MindIR graphs of a bundle of the preset (random weights, made in a temporary folder by
benchmarks/export_random_bundle.py: speed does not depend on the weights) against open_clip's
eager encoders. Tiny preset, batch 64, fp32, `--threads` on both sides.

Ratios are taken within a round only (the machine's speed drifts over minutes). Records every
run, with the commit, the machine and its load, in benchmarks/results/speed_vs_openclip.json.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import record  # benchmarks/record.py, beside this script

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent


def commands(args: argparse.Namespace, work: str, bundle: Path) -> dict[str, list[str]]:
    common = ["--batch-size", str(args.batch_size), "--threads", str(args.threads)]
    if work == "train":
        ours = [sys.executable, "-m", "benchmarks.throughput", "train", "--preset", args.preset,
                *common,
                "--steps", str(args.train_steps), "--warmup", "3"]
        peer = ["train", "--preset", args.preset, *common, "--steps", str(args.train_steps),
                "--warmup", "3"]
    else:
        ours = [sys.executable, "-m", "benchmarks.throughput", "encode", "--bundle", str(bundle),
                *common,
                "--steps", str(args.encode_steps)]
        peer = ["encode", "--preset", args.preset, *common, "--steps", str(args.encode_steps)]
    return {"clipms": ours, "clipms_unfused": [*ours, "--kernel-fusion", "off"],
            "open_clip": [args.peer_python, str(HERE / "openclip_peer.py"), *peer]}


def make_bundle(preset: str, folder: Path) -> Path:
    subprocess.run([sys.executable, str(HERE / "export_random_bundle.py"), "--preset", preset,
                    "--out", str(folder)], check=True, stdout=subprocess.DEVNULL)
    return folder


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer-python", default=os.environ.get(
        "CLIPMS_PEER_PYTHON", str(Path.home() / "venvs/openclip/bin/python")),
        help="the python of a virtualenv with torch and open_clip_torch "
             "(default: $CLIPMS_PEER_PYTHON or ~/venvs/openclip/bin/python)")
    p.add_argument("--works", nargs="+", choices=("train", "encode"), default=["train", "encode"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--train-steps", type=int, default=20)
    p.add_argument("--encode-steps", type=int, default=10)
    p.add_argument("--results", type=Path,
                   help="result file (default: benchmarks/results/speed_vs_openclip.json)")
    args = p.parse_args()
    if not Path(args.peer_python).exists():
        p.error(f"--peer-python {args.peer_python} does not exist: make a virtualenv with "
                "torch and open_clip_torch (benchmarks/openclip_peer.py says how)")
    recording = record.start("speed_vs_openclip")
    recording.command = recording.command.replace(args.peer_python, "<peer python>")
    runs = {}
    with tempfile.TemporaryDirectory(prefix="clipms-speed-") as tmp:
        bundle = make_bundle(args.preset, Path(tmp) / "bundle") if "encode" in args.works else None
        for work in args.works:
            runs[work] = record.alternate(commands(args, work, bundle), args.rounds)
    recording.write({"preset": args.preset, "batch_size": args.batch_size,
                     "threads": args.threads, "runs": runs}, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
