"""`python -m ops.preflight --smoke`: what a person on a new host runs first.

Three checks, one line each, on the device the params (and `--profile`) name:
- `smoke: loss`: a few amp steps of the run's model on one repeated random batch (a model that
  cannot lower the loss on one batch does not train): every loss finite, the last below the first.
- `smoke: lr reaches the graph`: the same run with lr 0, in a fresh process: the first losses
  agree (same seed, same batch), then the lr-0 run stays flat while the first one falls. A run
  that trained with another run's compiled graph (a stale compile cache) fails here.
- `smoke: export parity`: the first run's model exported as an fp32 MindIR bundle and checked
  against its checkpoint on the host CPU, where the bar was calibrated; on a device the device's
  own errors are printed beside it (clipms.deploy.hostparity).
Each run is a process of its own (`python -m ops.smoke train|export`), as each stage is.

On a device the runs use the profile's model and per-device batch, so the smoke also shows that
the batch fits in device memory. On CPU the model is the `mini` preset (the tokenizer's
vocabulary) at batch 8, so the smoke ends in a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ops.checks import FAIL, OK, Check

STEPS = 8  # amp skips the first steps while its loss scale falls from 2**16
CPU_PRESET, CPU_BATCH = "mini", 8
PARITY_BATCHES = (1, 4)
SAME = 1e-3  # relative: first-step losses of two runs, and an lr-0 run's losses, agree


@dataclass(frozen=True)
class SmokePlan:
    runtime: dict[str, Any]  # the runtime section (clipms.runtime.RuntimeConfig)
    model: dict[str, Any]  # CLIPConfig.to_dict()
    batch_size: int
    lr: float
    seed: int
    steps: int = STEPS

    @property
    def device(self) -> str:
        return str(self.runtime.get("device_target", "CPU"))


def smoke_plan(params: dict[str, Any], model: Any) -> SmokePlan:
    """The smoke run of a params dict whose model is `model` (a CLIPConfig, the preflight's
    `model_config`): that model and the run's batch on a device, the `mini` preset (with the
    model's vocabulary and context) at batch 8 on CPU; amp, the run's lr and seed."""
    from clipms.model.architecture import get_preset
    from clipms.train.recipe import TrainSettings

    train, runtime = params.get("train") or {}, dict(params.get("runtime") or {})
    defaults = TrainSettings()
    batch = int(train.get("batch_size", defaults.batch_size))
    if runtime.get("device_target", "CPU") == "CPU":
        small = get_preset(CPU_PRESET)
        model = dataclasses.replace(small, text=dataclasses.replace(
            small.text, vocab_size=model.text.vocab_size,
            context_length=model.text.context_length))
        batch = CPU_BATCH
    return SmokePlan(runtime=runtime, model=model.to_dict(), batch_size=batch,
                     lr=float(train.get("lr", defaults.lr)),
                     seed=int(train.get("seed", defaults.seed)))


# --- the checks (pure functions of what the runs returned) ------------------------------------
def check_loss(losses: list[float], plan: SmokePlan) -> Check:
    name = "smoke: loss"
    what = f"amp, {len(losses)} steps, batch {plan.batch_size} on {plan.device}"
    if not losses or not all(math.isfinite(x) for x in losses):
        return Check(name, FAIL, f"{what}: a loss is not finite: {_fmt(losses)}")
    if not losses[-1] < losses[0]:
        return Check(name, FAIL, f"{what}: the loss did not fall on one repeated batch: "
                     f"{_fmt(losses)}")
    return Check(name, OK, f"{what}: {_fmt(losses)}")


def check_lr(trained: list[float], frozen: list[float], lr: float) -> Check:
    """`frozen` is the lr-0 run: it starts where `trained` starts and stays there."""
    name = "smoke: lr reaches the graph"
    if not (frozen and trained) or not _close(frozen[0], trained[0]):
        return Check(name, FAIL, f"the two runs start apart ({frozen[:1]} vs {trained[:1]}): "
                     "same seed and batch should give the same first loss")
    if any(not _close(x, frozen[0]) for x in frozen) or _close(frozen[-1], trained[-1]):
        return Check(name, FAIL, f"lr 0 gave {_fmt(frozen)}, lr {lr:g} gave {_fmt(trained)}: "
                     "a run did not train with its own lr (a stale compiled graph?)")
    return Check(name, OK, f"lr 0 stays at {frozen[0]:.4f}, lr {lr:g} ends at "
                 f"{trained[-1]:.4f}: each run compiled its own graph")


def check_parity(report: dict[str, Any]) -> Check:
    name, metric = "smoke: export parity", report["gate_metric"]
    figures = (f"image {report['image_' + metric]:.1e}, text {report['text_' + metric]:.1e} "
               f"(bar {report['tolerance']:g}, {report['parity_device']})")
    if "device_image_" + metric in report:
        figures += (f"; on {report['parity_device']} itself: image "
                    f"{report['device_image_' + metric]:.1e}, text "
                    f"{report['device_text_' + metric]:.1e} (reported, not gated)")
    return Check(name, OK if report["passed"] else FAIL, figures)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= SAME * max(abs(a), abs(b), 1e-12)


def _fmt(losses: list[float]) -> str:
    return " -> ".join(f"{x:.4f}" for x in losses)


# --- the runs ---------------------------------------------------------------------------------
def run_smoke(plan: SmokePlan, workdir: Path | None = None, timeout: float = 1800) -> list[Check]:
    """The three smoke checks of `plan`; each run in a process of its own."""
    with tempfile.TemporaryDirectory(prefix="clipms-smoke-") as tmp:
        root = Path(workdir or tmp)
        (root / "plan.json").write_text(json.dumps(dataclasses.asdict(plan)))
        try:
            trained = _child(["train", str(root), str(plan.lr), "trained"], timeout)
            frozen = _child(["train", str(root), "0", "frozen"], timeout)
        except RuntimeError as err:
            return [Check("smoke: loss", FAIL, str(err))]
        checks = [check_loss(trained, plan), check_lr(trained, frozen, plan.lr)]
        try:
            checks.append(check_parity(_child(["export", str(root)], timeout)))
        except RuntimeError as err:
            checks.append(Check("smoke: export parity", FAIL, str(err)))
        if workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    return checks


def _child(args: list[str], timeout: float) -> Any:
    """Run `python -m ops.smoke ARGS` and return the JSON it prints last."""
    project = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (project, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-m", "ops.smoke", *args], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=project)
    if proc.returncode != 0:
        raise RuntimeError(f"`{args[0]}` failed (exit {proc.returncode}): "
                           f"{proc.stderr.strip()[-1500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def train_child(root: Path, lr: float, name: str) -> list[float]:
    """A few amp steps of the plan on one repeated batch; saves the model (for `export`)."""
    from clipms.model.architecture import CLIPConfig
    from clipms.runtime import RuntimeConfig
    from clipms.train.loop import save_model, train
    from clipms.train.recipe import TrainConfig

    plan = SmokePlan(**json.loads((root / "plan.json").read_text()))
    model = CLIPConfig.from_dict(plan.model)
    cfg = TrainConfig(model=model, batch_size=plan.batch_size, precision="amp", lr=lr,
                      warmup_steps=0, max_steps=plan.steps, seed=plan.seed,
                      runtime=RuntimeConfig(**plan.runtime))
    result = train(cfg, RepeatedBatch(model, plan.batch_size, plan.steps, seed=plan.seed))
    save_model(result.model, root / f"{name}.ckpt")
    return [row["loss"] for row in result.history]


class RepeatedBatch:
    """One random batch, served at every step (RandomBatches' first)."""

    def __init__(self, model: Any, batch_size: int, steps: int, seed: int) -> None:
        from clipms.train.feed import RandomBatches

        self.batch = RandomBatches(model, batch_size, steps, seed=seed).global_batch(0, 0)
        self.batches_per_epoch = steps

    def stream(self, start: int, stop: int) -> Any:
        return (self.batch for _ in range(start, stop))


def export_child(root: Path) -> dict[str, Any]:
    """The trained run's model as an fp32 bundle, its parity here and, off CPU, on the host."""
    import numpy as np

    from clipms.data.preprocess import PreprocessConfig
    from clipms.deploy.hostparity import gate_on_host, host_parity
    from clipms.deploy.mindir import export_bundle, parity_report
    from clipms.model.architecture import CLIPConfig
    from clipms.runtime import RuntimeConfig, configure
    from clipms.text.clip_tokenizer import Tokenizer
    from clipms.train.feed import RandomBatches
    from clipms.train.trained import load_clip

    plan = SmokePlan(**json.loads((root / "plan.json").read_text()))
    configure(RuntimeConfig(**plan.runtime))
    model = CLIPConfig.from_dict(plan.model)
    tokenizer = root / "tokenizer.json"  # the bundle needs one; the checks feed random ids
    Tokenizer.openai(model.text.context_length).save(tokenizer)
    checkpoint, bundle = root / "trained.ckpt", root / "bundle"
    preprocess = PreprocessConfig(image_size=model.vision.image_size)
    export_bundle(load_clip(checkpoint, model), preprocess, tokenizer, bundle)
    pixels, tokens = RandomBatches(model, max(PARITY_BATCHES), 1, seed=plan.seed).global_batch(0, 0)
    images = ((pixels / np.float32(255.0) - 0.45) / 0.27).astype(np.float32)
    here = parity_report(load_clip(checkpoint, model), bundle, images, tokens, PARITY_BATCHES)
    return gate_on_host(here, plan.device, lambda: host_parity(
        bundle, checkpoint, model, images, tokens, PARITY_BATCHES))


def main(argv: list[str] | None = None) -> int:
    """`python -m ops.smoke train ROOT LR NAME | export ROOT`: one smoke run (internal)."""
    parser = argparse.ArgumentParser(prog="python -m ops.smoke", description=main.__doc__)
    sub = parser.add_subparsers(dest="what", required=True)
    one = sub.add_parser("train")
    one.add_argument("root", type=Path)
    one.add_argument("lr", type=float)
    one.add_argument("name")
    sub.add_parser("export").add_argument("root", type=Path)
    args = parser.parse_args(argv)
    if args.what == "train":
        print(json.dumps(train_child(args.root, args.lr, args.name)))
    else:
        print(json.dumps(export_child(args.root)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
