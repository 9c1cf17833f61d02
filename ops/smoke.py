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
- `smoke: data parallel` (a profile of several ranks): the distributed path through msrun, as the
  run takes it (`clipms.parallel.launch`): ranks train a few fp32 steps on their slices of random
  global batches, and a single process trains the same steps on the whole global batches. Every
  rank's loss and gradient norm must equal the single process's within DP_SAME (relative): a
  rank whose gradients were not averaged (the reducer) would show its own half's norm, a loss
  over its own negatives only (no AllGather, or its gradient wrong from step 2 on) its own loss.
  A rank that fails is named, with its error.
Each run is a process of its own (`python -m ops.smoke train|export|dp-single`, msrun's
workers), as each stage is.

On a device the runs use the profile's model and per-device batch, so the smoke also shows that
the batch fits in device memory. On CPU the model is the `mini` preset (the tokenizer's
vocabulary) at batch 8, so the smoke ends in a few minutes on 2 cores. The data-parallel check
runs the profile's model at DP_BATCH a rank on each NPU of this host, its single process on the
global batch on one; on CPU, 2 workers (as tests/clipms/parallel/test_launch.py runs them) of
a model of one layer a tower.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ops.checks import FAIL, OK, Check

STEPS = 8  # amp skips the first steps while its loss scale falls from 2**16
CPU_PRESET, CPU_BATCH = "mini", 8
PARITY_BATCHES = (1, 4)
SAME = 1e-3  # relative: first-step losses of two runs, and an lr-0 run's losses, agree
# The data-parallel check: steps, batch per rank on a device (its single process holds the global
# batch on one NPU), CPU's workers and batch per rank, and the agreement asked of the ranks and
# the single process (the msrun tests see 1e-5 at step 1 and <1e-3 later: summation order).
DP_STEPS, DP_BATCH, CPU_RANKS, CPU_DP_BATCH = 3, 8, 2, 4
DP_SAME = 1e-3


@dataclass(frozen=True)
class SmokePlan:
    runtime: dict[str, Any]  # the runtime section (clipms.runtime.RuntimeConfig)
    model: dict[str, Any]  # CLIPConfig.to_dict()
    batch_size: int
    lr: float
    seed: int
    steps: int = STEPS
    ranks: int = 1  # the data-parallel check's msrun workers; 1: the run has one rank, no check
    dp_model: dict[str, Any] | None = None  # the model of the data-parallel check
    dp_batch: int = DP_BATCH  # a rank's batch there

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
    dist = train.get("distributed") or {}
    ranks = int(dist.get("workers", 1)) // max(1, int(dist.get("nodes", 1)))  # on this host
    dp_model, dp_batch = model, DP_BATCH
    if runtime.get("device_target", "CPU") == "CPU":
        small = get_preset(CPU_PRESET)
        model = dataclasses.replace(small, text=dataclasses.replace(
            small.text, vocab_size=model.text.vocab_size,
            context_length=model.text.context_length))
        batch = CPU_BATCH
        dp_model, dp_batch, ranks = cpu_dp_model(), CPU_DP_BATCH, CPU_RANKS
    several = int(dist.get("workers", 1)) > 1
    return SmokePlan(runtime=runtime, model=model.to_dict(), batch_size=batch,
                     lr=float(train.get("lr", defaults.lr)),
                     seed=int(train.get("seed", defaults.seed)),
                     ranks=max(2, ranks) if several else 1,
                     dp_model=dp_model.to_dict() if several else None, dp_batch=dp_batch)


def cpu_dp_model() -> Any:
    """The data-parallel check's model on CPU: the `tiny` preset cut to one layer a tower at
    width 32 (the check is about the collectives, not the model), as
    tests/clipms/parallel/test_launch.py's."""
    from clipms.model.architecture import get_preset

    tiny = get_preset("tiny")
    return dataclasses.replace(
        tiny, embed_dim=16,
        vision=dataclasses.replace(tiny.vision, image_size=16, patch_size=8, width=32, layers=1,
                                   head_width=16, stem="patch", patch_dropout=0.0),
        text=dataclasses.replace(tiny.text, context_length=8, vocab_size=40, width=32, heads=2,
                                 layers=1))


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


def check_data_parallel(single: list[dict[str, float]] | str,
                        ranks: dict[int, list[dict[str, float]] | str], launch_error: str,
                        plan: SmokePlan) -> Check:
    """`ranks`: each msrun rank's rows (loss, grad_norm a step) or what went wrong; `single`:
    the single process's rows on the global batches, or its error; `launch_error`: msrun's."""
    name = "smoke: data parallel"
    what = (f"{plan.ranks} msrun ranks x batch {plan.dp_batch} on {plan.device}, "
            f"{DP_STEPS} fp32 steps")
    failed = {rank: got for rank, got in ranks.items() if isinstance(got, str)}
    if failed:  # the ranks that failed themselves first, then those stopped with them
        order = sorted(failed, key=lambda rank: (not failed[rank].startswith("failed"), rank))
        return Check(name, FAIL, f"{what}: " + "; ".join(
            f"rank {rank} {failed[rank]}" for rank in order))
    if launch_error:
        return Check(name, FAIL, f"{what}: every rank finished, but {launch_error}")
    if isinstance(single, str):
        return Check(name, FAIL, f"{what}: the single-process reference failed: {single}")
    for rank, rows in sorted(ranks.items()):
        for key in ("loss", "grad_norm"):
            got, want = [r[key] for r in rows], [r[key] for r in single]
            if len(got) != len(want) or not all(
                    _close(a, b, DP_SAME) for a, b in zip(got, want, strict=False)):
                return Check(name, FAIL, f"{what}: rank {rank}'s {key} {_fmt(got)} is not one "
                             f"process's on the global batch, {_fmt(want)} (within "
                             f"{DP_SAME:g} relative): " + _dp_hint(key))
    return Check(name, OK, f"{what}: every rank's global loss ({_fmt([r['loss'] for r in single])})"
                 f" and gradient norm ({_fmt([r['grad_norm'] for r in single])}) are one "
                 f"process's on the global batch within {DP_SAME:g}: gradients averaged, "
                 "features all-gathered")


def _dp_hint(key: str) -> str:
    return ("the gradient reducer did not average the ranks' gradients" if key == "grad_norm"
            else "the features were not all-gathered, or their gradient is wrong")


def _close(a: float, b: float, rel: float = SAME) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


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
        if plan.ranks > 1:
            checks.append(run_data_parallel(root, plan, timeout))
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


# What each msrun worker of the data-parallel check runs (a script outside the package, as the
# launcher's own).
_DP_WORKER = "import sys\nfrom ops.smoke import dp_child\ndp_child(sys.argv[1], True)\n"


def run_data_parallel(root: Path, plan: SmokePlan, timeout: float) -> Check:
    """The data-parallel check's runs (`root/plan.json` is the plan) and its verdict."""
    try:
        single: list[dict[str, float]] | str = _child(["dp-single", str(root)], timeout)
    except RuntimeError as err:
        single = str(err)
    return check_data_parallel(single, *run_ranks(root, plan, timeout), plan)


def run_ranks(root: Path, plan: SmokePlan,
              timeout: float) -> tuple[dict[int, list[dict[str, float]] | str], str]:
    """(each rank's rows or what went wrong, msrun's error or ""), from `plan.ranks` msrun
    workers started by the run's own launcher (`clipms.parallel.launch.run_workers`)."""
    from clipms.parallel.launch import Cluster, LaunchError, run_workers

    logs = root / "dp-logs"
    logs.mkdir(parents=True, exist_ok=True)
    launch_error = ""
    try:
        run_workers(Cluster(workers=plan.ranks), logs, _DP_WORKER, [str(root)], plan.device,
                    timeout)
    except LaunchError as err:
        launch_error = str(err).splitlines()[0]
    return ({rank: _rank_outcome(root, logs, rank, launch_error)
             for rank in range(plan.ranks)}, launch_error)


def _rank_outcome(root: Path, logs: Path, rank: int,
                  launch_error: str) -> list[dict[str, float]] | str:
    """A rank's rows, its own error, or what msrun and its log say when it left neither."""
    rows, error = root / f"dp-rank{rank}.json", root / f"dp-rank{rank}.error"
    if error.exists():
        return "failed: " + _exception_line(error.read_text())
    if rows.exists():
        return json.loads(rows.read_text())
    log = logs / f"worker_{rank}.log"
    error_line = _last_error(log)
    return (f"no result ({launch_error or 'msrun exited 0'}: stopped when another rank failed, "
            f"or crashed; {log})" + (f": {error_line}" if error_line else ""))


def _exception_line(text: str) -> str:
    """The `SomeError: message` line of a traceback; MindSpore's put the message on the lines
    after an empty `RuntimeError:` (under a dashed header) and end in a C++ call stack."""
    lines = [line.strip() for line in text.strip().splitlines()]
    found = [i for i, line in enumerate(lines)
             if re.match(r"^[\w.]+(Error|Exception|Interrupt|Exit)\b", line)]
    if not found:
        return (lines[-1] if lines else "no message")[:500]
    head, rest = lines[found[-1]], lines[found[-1] + 1:]
    if head.endswith(":"):  # the message follows: its first line that is not a header
        words = [line for line in rest if line and not line.startswith("-")]
        head = f"{head} {words[0]}" if words else head
    return head[:500]


def _last_error(log: Path) -> str:
    """The last `[ERROR]` line of a worker's log (MindSpore's own), or ""."""
    if not log.exists():
        return ""
    errors = [line for line in log.read_text(errors="replace").splitlines()
              if line.startswith("[ERROR]")]
    return errors[-1][:500] if errors else ""


def dp_child(root: Path | str, distributed: bool) -> list[dict[str, float]]:
    """DP_STEPS fp32 steps of the plan's data-parallel model: on this rank's slice of the random
    global batches (`distributed`, an msrun worker: writes `dp-rank<R>.json`, or `.error`), or
    in one process on the whole global batches."""
    root = Path(root)
    if distributed and os.environ.get("MS_ROLE") == "MS_SCHED":
        # msrun runs the script as its scheduler too: that process only serves the cluster
        from clipms.train.collectives import init_distributed

        init_distributed()
        return []
    rank = int(os.environ.get("RANK_ID", "0")) if distributed else 0  # msrun's global rank
    try:
        rows = _dp_train(root, distributed)
        if distributed:
            (root / f"dp-rank{rank}.json").write_text(json.dumps(rows))
    except BaseException:
        if distributed:
            (root / f"dp-rank{rank}.error").write_text(traceback.format_exc()[-3000:])
        raise
    return rows


def _dp_train(root: Path, distributed: bool) -> list[dict[str, float]]:
    from clipms.model.architecture import CLIPConfig
    from clipms.runtime import RuntimeConfig
    from clipms.train.collectives import init_distributed
    from clipms.train.feed import RandomBatches
    from clipms.train.loop import train
    from clipms.train.recipe import TrainConfig

    plan = SmokePlan(**json.loads((root / "plan.json").read_text()))
    model = CLIPConfig.from_dict(plan.dp_model or plan.model)
    rank, size = init_distributed() if distributed else (0, 1)
    batch = plan.dp_batch if distributed else plan.dp_batch * plan.ranks
    cfg = TrainConfig(model=model, batch_size=batch, precision="fp32", lr=plan.lr,
                      warmup_steps=0, max_steps=DP_STEPS, seed=plan.seed,
                      runtime=RuntimeConfig(**plan.runtime))
    # the same global batches either way: RandomBatches draws batch x group rows per index
    source = RandomBatches(model, batch, DP_STEPS, seed=plan.seed, rank=rank, world_size=size)
    result = train(cfg, source, distributed=distributed)
    return [{"loss": row["loss"], "grad_norm": row["grad_norm"]} for row in result.history]


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
    """`python -m ops.smoke train ROOT LR NAME | export ROOT | dp-single ROOT`: one smoke
    run (internal)."""
    parser = argparse.ArgumentParser(prog="python -m ops.smoke", description=main.__doc__)
    sub = parser.add_subparsers(dest="what", required=True)
    one = sub.add_parser("train")
    one.add_argument("root", type=Path)
    one.add_argument("lr", type=float)
    one.add_argument("name")
    sub.add_parser("export").add_argument("root", type=Path)
    sub.add_parser("dp-single").add_argument("root", type=Path)
    args = parser.parse_args(argv)
    if args.what == "train":
        print(json.dumps(train_child(args.root, args.lr, args.name)))
    elif args.what == "dp-single":
        print(json.dumps(dp_child(args.root, distributed=False)))
    else:
        print(json.dumps(export_child(args.root)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
