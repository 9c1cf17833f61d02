"""A warm night against a cold one, on the synthetic world grown by 10% (commands, not tests).

    python benchmarks/warm_start.py --work /scratch/warm [--seeds 0 1] [--grow 0.1]
        [--warm-steps 300 600] [--out benchmarks/results/warm_start.json]

For each seed, in a folder of its own under --work, the pipeline's stages run as DVC runs them
(`python -m stages.<name>` in that folder, with params.yaml = the project's defaults and
`train.seed` = the seed; MLflow in the folder's own mlflow.db):

- day 1: every stage up to `register` (the search index left out): v1 becomes the champion, and
  its checkpoint is logged with it;
- day 2: `metadata.num_images` grown by --grow (the generator keeps the first images
  identical), the data stages again, then
  - kept: day 1's model scored on day 2's val split (no training),
  - cold: tokenizer trained again and training from scratch, the default (`epochs`),
  - warm-N: `tokenizer.pin` and `train.init_from` = models:/clip@champion, N steps
    (`train.warm_start.max_steps`), as many variants as --warm-steps,
  each scored by the `evaluate` stage on the same day-2 val split. Cold and the warm variants
  alternate their order from seed to seed (the machine is shared: its load drifts).

The JSON (benchmarks/record.py's envelope: command, commit, machine, load at the start and end)
holds the 1-minute load before and after every training, and per seed and variant the evaluation
metrics, the optimizer steps, the training stage's wall time and metrics/train.json's own wall
time. It is rewritten after every variant, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))  # harness/

import record  # noqa: E402 - benchmarks/record.py

from harness import project_copy  # noqa: E402

DATA_STAGES = ("metadata", "dedupe", "download", "shard")
CHAMPION = "models:/clip@champion"
REPORTED = ("i2t_R@1", "i2t_R@5", "t2i_R@1", "t2i_R@5", "mAP@10", "zeroshot_top1",
            "zeroshot_colour_top1", "zeroshot_shape_top1", "num_images", "num_captions")


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="a scratch folder")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--grow", type=float, default=0.1, help="share of images added on day 2")
    parser.add_argument("--warm-steps", type=int, nargs="+", default=[300, 600])
    parser.add_argument("--out", type=Path,
                        default=ROOT / "benchmarks" / "results" / "warm_start.json")
    parser.add_argument("-S", "--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a params override for both days (YAML value), e.g. for a smoke run")
    return parser.parse_args()


def overrides_of(pairs: list[str]) -> dict[str, Any]:
    return {key: yaml.safe_load(value) for key, value in (p.split("=", 1) for p in pairs)}


def set_params(folder: Path, overrides: dict[str, Any]) -> None:
    """Apply {"section.key": value} to the folder's params.yaml."""
    project_copy.set_params(folder / "params.yaml", overrides)


def stage(folder: Path, name: str) -> float:
    """Run one stage as `dvc repro` would (cwd = the project folder); its wall time in s."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MLFLOW_TRACKING_URI", None)  # the folder's own mlflow.db
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", f"stages.{name}"], cwd=folder, env=env,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"stage {name} in {folder} exited {proc.returncode}:\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    print(f"  {name}: {seconds:.0f} s", flush=True)
    return seconds


def read(folder: Path, relative: str) -> dict[str, Any]:
    return json.loads((folder / relative).read_text())


def scored(folder: Path) -> dict[str, float]:
    found = read(folder, "metrics/eval.json")
    return {key: found[key] for key in REPORTED if key in found}


def train_and_score(folder: Path, overrides: dict[str, Any]) -> dict[str, Any]:
    """tokenizer -> train -> evaluate with `overrides`; what they took and gave."""
    set_params(folder, overrides)
    shutil.rmtree(folder / "models" / "checkpoints", ignore_errors=True)  # never resume
    load_before = os.getloadavg()[0]
    tokenizer_s = stage(folder, "tokenizer")
    train_s = stage(folder, "train")
    load_after = os.getloadavg()[0]
    stage(folder, "evaluate")
    train = read(folder, "metrics/train.json")
    return {"overrides": overrides, "tokenizer_stage_s": round(tokenizer_s, 1),
            "train_stage_s": round(train_s, 1), "train_wall_time_s": round(train["wall_time_s"], 1),
            "steps": int(train["steps"]), "final_loss": train["final_loss"],
            "samples_per_s": round(train["samples_per_s"], 1),
            "load_1min": [round(load_before, 2), round(load_after, 2)],
            "tokenizer_from": read(folder, "metrics/tokenizer.json").get(
                "lineage.tokenizer_from"), "eval": scored(folder)}


def day_one(folder: Path, seed: int, overrides: dict[str, Any]) -> dict[str, Any]:
    folder.mkdir(parents=True)
    shutil.copy2(ROOT / "params.yaml", folder / "params.yaml")
    set_params(folder, {**overrides, "train.seed": seed, "train.resume": "never"})
    for name in DATA_STAGES:
        stage(folder, name)
    result = train_and_score(folder, {})
    stage(folder, "export")
    stage(folder, "register")
    result["register"] = {k: v for k, v in read(folder, "metrics/register.json").items()
                          if k in ("version", "alias", "reason")}
    return result


def day_two(folder: Path, seed: int, grow: float, warm_steps: list[int],
            seed_record: dict[str, Any], save: Any) -> None:
    images = yaml.safe_load((folder / "params.yaml").read_text())["metadata"]["num_images"]
    set_params(folder, {"metadata.num_images": round(images * (1 + grow))})
    for name in DATA_STAGES:
        stage(folder, name)
    stage(folder, "evaluate")  # day 1's model (still in models/) on day 2's val split
    seed_record["kept"] = {"eval": scored(folder)}
    save()
    cold = {"tokenizer.pin": None, "train.init_from": None}
    variants = [("cold", cold)] + [
        (f"warm-{steps}", {"tokenizer.pin": CHAMPION, "train.init_from": CHAMPION,
                           "train.warm_start.max_steps": steps}) for steps in warm_steps]
    if seed % 2 == 0:
        variants.reverse()
    for name, overrides in variants:
        print(f" seed {seed} day 2 {name}", flush=True)
        seed_record[name] = train_and_score(folder, overrides)
        save()


def main() -> None:
    args = _parse()
    recording = record.start("warm_start")
    results: dict[str, Any] = {"grow": args.grow, "warm_steps": args.warm_steps,
                               "params_overrides": overrides_of(args.set), "seeds": {}}

    def save() -> None:
        recording.write(results, args.out)

    for seed in args.seeds:
        folder = args.work / f"seed-{seed}"
        seed_record: dict[str, Any] = {}
        results["seeds"][str(seed)] = seed_record
        print(f"seed {seed} day 1", flush=True)
        seed_record["day1"] = day_one(folder, seed, overrides_of(args.set))
        save()
        print(f"seed {seed} day 2", flush=True)
        day_two(folder, seed, args.grow, args.warm_steps, seed_record, save)
    save()


if __name__ == "__main__":
    main()
