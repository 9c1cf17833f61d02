"""A night as a whole: what it may change, what a failed one puts back, and what it tells a person.

A night runs the DVC stages one after another; the first failure stops it. Without this module a
failed night would leave the stages that finished with tonight's outputs and `dvc.lock` entries,
and the failed stage with none (DVC deletes a stage's outputs before running it). So a night
remembers, before its first stage, the state the last good night left: `dvc.lock` and the small
files DVC does not cache (metrics/, plots/); on failure it writes them back and `dvc checkout`
restores the cached outputs from the lock. The registry is not touched here: the champion moves
only when `register` finishes, and the service follows the champion. Training checkpoints
(`models/checkpoints`, persisted) are left for the next night to resume from.

`diagnose` names a failure from the stage and the output DVC captured: the kind, the reason in a
line, and what a person should do. One notice per night is sent with it (flows/notify.py).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

LOCK = Path("dvc.lock")
# Small uncached outputs a failed night puts back (the persisted ones stay as the stage left them).
RESTORED_FOLDERS = ("metrics", "plots")
# The inputs of `train` that are data (all under data/): when none changed since the last trained
# night, the night has no new data.
DATA_PREFIX = "data/"
TRAIN_STAGE = "train"

NO_NEW_DATA = "no new data"


@dataclass(frozen=True)
class Diagnosis:
    """Why a night stopped, in words for the person who reads the notice."""

    stage: str
    kind: str    # broken source, diverging training, killed, disk full, registry outage, ...
    reason: str  # one line, from the stage's own output
    advice: str  # what to do

    def text(self) -> str:
        return f"stage '{self.stage}': {self.kind}: {self.reason}\nWhat to do: {self.advice}"


class NightFailed(RuntimeError):
    """A night stopped at a stage; carries the diagnosis the notice is made of."""

    def __init__(self, diagnosis: Diagnosis, detail: str = "") -> None:
        # the stage's own words after the diagnosis: a reason line cannot hold every message
        super().__init__(diagnosis.text() + (f"\n\n{detail}" if detail else ""))
        self.diagnosis = diagnosis


# (kind, pattern in the failed stage's output, advice); the first match wins, so the patterns
# that name a cause outright (the disk, a signal) come before the ones that name a stage's trade.
_RULES: tuple[tuple[str, str, str], ...] = (
    ("disk full", r"No space left on device|ENOSPC|Disk quota exceeded|File too large",
     "free space on the disk that holds the workspace, the DVC cache or the MLflow store "
     "(retention removes old versions' artifacts; `dvc gc` the cache), then rerun the night"),
    ("killed", r"exited with -\d+\b|exited with 137\b|\bSIGKILL\b|Killed\b",
     "the stage's process was killed (out of memory, or by a person or the scheduler): check the "
     "machine's memory and the kernel log (`dmesg`), then rerun; training resumes from its last "
     "checkpoint"),
    ("diverging training", r"NonFiniteLossError|loss is (?:nan|inf)|gradient norm is (?:nan|inf)"
     r"|steps? (?:were |was )?skipped|not finite",
     "training diverged or wasted its steps: lower train.lr (or train.warm_start.lr), check "
     "train.loss_scale under amp, and look at plots/train.csv; the champion was not touched"),
    ("registry outage", r"MlflowException|Connection refused|Max retries exceeded|"
     r"database is locked|OperationalError|tracking server",
     "the MLflow registry could not be reached or written: check the tracking server (or "
     "mlflow.db) and rerun; the champion and its serving are unchanged"),
    ("bad data", r"changes: error|check(?:s)? failed|failed check",
     "the new data failed the change report's checks (metrics/changes.json says which): fix the "
     "source export, or loosen the `changes` params if the change is intended"),
    ("broken source", r"metadata: error|download: error|HTTP Error|HTTPError|URLError|"
     r"Parquet|parquet|JSONDecodeError|No such file or directory|Name or service not known|"
     r"timed out",
     "the data source could not be read: check that metadata.path/metadata.url is reachable and "
     "holds a valid export, then rerun"),
)
_SOURCE_STAGES = ("metadata", "dedupe", "download")
_BY_STAGE = ("broken source", "registry outage")  # kinds told apart by the stage that failed


def diagnose(stage: str, output: str) -> Diagnosis:
    """The kind of failure, its reason (the most telling line of `output`) and what to do."""
    for kind, pattern, advice in _RULES:
        if (kind == "broken source") != (stage in _SOURCE_STAGES) and kind in _BY_STAGE:
            continue  # a refused connection is the source's in a data stage, else the registry's
        if reason := _reason(output, pattern):
            return Diagnosis(stage, kind, reason, advice)
    if stage in _SOURCE_STAGES:
        return Diagnosis(stage, "broken source", _last_error_line(output), _RULES[-1][2])
    return Diagnosis(stage, "stage failed", _last_error_line(output),
                     f"read the stage's log (`dvc repro {stage}` reproduces it), fix the cause "
                     "and rerun")


def _reason(output: str, pattern: str) -> str | None:
    """The line that says it best: the last matching line that is an error message (not a
    traceback frame, not DVC's summary line), else the last matching line; None: no match."""
    lines = [ln.strip() for ln in output.splitlines()]
    found = [ln for ln in lines if re.search(pattern, ln) and not ln.startswith('File "')]
    if not found:
        return None
    said = [ln for ln in found if re.search(r"Error|Exception|error:", ln)
            and not ln.startswith("ERROR: failed to reproduce")]
    return _short((said or found)[-1])


def _last_error_line(output: str) -> str:
    """The last line that says error (DVC's own 'failed to reproduce' line is the fallback)."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    own = [ln for ln in lines if re.search(r"error|Error|failed", ln)
           and not ln.startswith("ERROR: failed to reproduce")]
    return _short((own or lines or ["no output"])[-1])


def _short(line: str, limit: int = 300) -> str:
    line = line.strip()
    return line if len(line) <= limit else line[: limit - 3] + "..."


class Snapshot:
    """The workspace state a failed night puts back: dvc.lock and the small uncached outputs,
    kept on disk (`.dvc/tmp/clipms-night/`) while the night runs. A night whose process was
    killed leaves it behind: the next night finds it, puts the workspace back and says so."""

    FOLDER = Path(".dvc/tmp/clipms-night")

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.folder = workdir / self.FOLDER
        self.manifest = self.folder / "night.json"

    @classmethod
    def take(cls, workdir: Path, run: str) -> Snapshot:
        snap = cls(workdir)
        shutil.rmtree(snap.folder, ignore_errors=True)
        files = [str(LOCK)] + [str(p.relative_to(workdir)) for folder in RESTORED_FOLDERS
                               for p in sorted((workdir / folder).rglob("*")) if p.is_file()]
        present = []
        for rel in files:
            if (workdir / rel).is_file():
                target = snap.folder / "files" / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(workdir / rel, target)
                present.append(rel)
        snap._write({"run": run, "files": present, "stage": None})
        return snap

    @classmethod
    def left_behind(cls, workdir: Path) -> tuple[Snapshot, dict[str, object]] | None:
        """The snapshot of a night that never finished (its process was killed), if any."""
        snap = cls(workdir)
        try:
            return snap, json.loads(snap.manifest.read_text())
        except (OSError, ValueError):
            shutil.rmtree(snap.folder, ignore_errors=True)  # half written: nothing to restore
            return None

    def at_stage(self, stage: str) -> None:
        """Record the stage the night is in (what the next night names, if this one dies)."""
        self._write({**json.loads(self.manifest.read_text()), "stage": stage})

    def _write(self, manifest: dict[str, object]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.manifest.with_suffix(".tmp")
        tmp.write_text(json.dumps(manifest))
        tmp.replace(self.manifest)

    def restore(self, dvc: Callable[[list[str], Path], str]) -> list[str]:
        """Put the files back (removing the ones tonight created), then `dvc checkout` the
        cached outputs `dvc.lock` names. Returns the paths that differed."""
        workdir = self.workdir
        saved = set(json.loads(self.manifest.read_text())["files"])
        changed: list[str] = []
        for folder in RESTORED_FOLDERS:
            for path in sorted((workdir / folder).rglob("*")):
                rel = str(path.relative_to(workdir))
                if path.is_file() and rel not in saved:
                    path.unlink()
                    changed.append(rel)
        if str(LOCK) not in saved:
            (workdir / LOCK).unlink(missing_ok=True)
        for rel in sorted(saved):
            source, path = self.folder / "files" / rel, workdir / rel
            if _read(path) == source.read_bytes():
                continue
            changed.append(rel)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.restore")
            shutil.copy2(source, tmp)
            tmp.replace(path)
        if str(LOCK) in saved:
            dvc(["checkout", "--force", "--allow-missing", "--quiet"], workdir)
        return changed

    def discard(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _read(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


def new_data_for_training(status: dict[str, object], workdir: Path) -> bool:
    """True when `train` would see data it has not trained on: it never ran, or `dvc status`
    (`status`, for the train stage) reports a changed input under data/."""
    if not _trained_before(workdir):
        return True
    for entry in status.get(TRAIN_STAGE) or []:  # type: ignore[union-attr]
        if isinstance(entry, dict):
            deps = entry.get("changed deps") or {}
            if any(str(path).startswith(DATA_PREFIX) for path in deps):
                return True
    return False


def _trained_before(workdir: Path) -> bool:
    path = workdir / LOCK
    if not path.is_file():
        return False
    return TRAIN_STAGE in ((yaml.safe_load(path.read_text()) or {}).get("stages") or {})


def killed_night_diagnosis(manifest: dict[str, object]) -> Diagnosis:
    """The notice of a night whose own process died (no one was left to send it)."""
    stage = str(manifest.get("stage") or "plan")
    return Diagnosis(
        stage, "killed",
        f"the night {manifest.get('run')} stopped during stage '{stage}' without finishing: its "
        "process was killed (the worker, the machine, or out of memory); this night put the "
        "workspace back as the last good night left it",
        "check the worker's machine (memory, `dmesg`, restarts); nothing else: this night runs "
        "the stages again and training resumes from its last checkpoint")


def no_new_data_diagnosis() -> Diagnosis:
    return Diagnosis(
        TRAIN_STAGE, NO_NEW_DATA,
        "no input of train under data/ changed since the last trained night: nothing was trained, "
        "evaluated or registered",
        "nothing, if the source had nothing new tonight; otherwise check that the source export "
        "(metadata.path / metadata.url) was updated. To train anyway, run the flow with "
        "train_without_new_data=true")
