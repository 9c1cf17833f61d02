"""What a run was made from, read from git, `dvc.lock` and the shard manifest: lineage tags, the
params the data stages ran with, the evaluation-set digest and the dataset input record.

Nothing here talks to MLflow; the values are plain strings, made safe to log (`safe_params`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from clipms.utils.jsonio import read_json
from clipms.utils.redact import redact_text

# Stages that never talk to MLflow: their resolved params are taken from dvc.lock by `open`.
DATA_STAGES = ("metadata", "dedupe", "download", "shard", "tokenizer", "changes")
# The sections of the data-change report (metrics/changes.json) whose numbers become metrics.
DATA_CHANGE_SECTIONS = ("rows", "images", "download", "captions", "tokens", "image_size")
SECRET_KEY = re.compile(r"(password|passwd|secret|credential|api_?key|(^|_)token$)", re.IGNORECASE)
MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value


def flatten(prefix: str, value: Any) -> dict[str, str]:
    """{"train.lr": "0.0005", "export.batch_sizes": "[1, 7, 32]"} from nested mappings."""
    if isinstance(value, Mapping):
        out: dict[str, str] = {}
        for key, sub in value.items():
            out.update(flatten(f"{prefix}.{key}" if prefix else str(key), sub))
        return out
    if isinstance(value, list | tuple):
        return {prefix: json.dumps(list(value))}
    return {prefix: str(value)}


def safe_params(params: Mapping[str, str]) -> dict[str, str]:
    """Drop what must never be logged: secret-looking keys' values, the credentials, query
    strings and fragments of URLs (presigned signatures, tokens), the user's home directory."""
    home = str(Path.home())
    out = {}
    for key, value in params.items():
        leaf = key.rsplit(".", 1)[-1]
        # a secret-looking key's value whole; URLs and host strings (user:password@host) in part
        value = "<redacted>" if SECRET_KEY.search(leaf) else redact_text(value)
        if home not in ("", "/") and home in value:
            value = value.replace(home, "~")
        out[key] = value[:MAX_PARAM_CHARS]
    return out


def _git(*args: str) -> str | None:
    """git's output, unstripped (a status line may start with a space), or None on failure."""
    try:
        proc = subprocess.run(["git", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def read_lock(path: Path) -> dict[str, Any]:
    """dvc.lock's stages, or {} when the pipeline has not been locked yet."""
    if not path.exists():
        return {}
    return (yaml.safe_load(path.read_text()) or {}).get("stages", {})


def lock_hash(lock: Mapping[str, Any], out_path: str) -> str | None:
    """The DVC hash (md5, `.dir` suffix dropped) of an out path in dvc.lock. For a folder whose
    parts are separate outs (data/shards/train, .../val, .../manifest.json), the md5 of their
    sorted "path md5" lines: it changes exactly when one of their DVC hashes changes."""
    found = {}
    for stage in lock.values():
        for out in stage.get("outs", []):
            path, md5 = out.get("path", ""), out.get("md5")
            if md5 and (path == out_path or path.startswith(out_path.rstrip("/") + "/")):
                found[path] = str(md5).removesuffix(".dir")
    if not found:
        return None
    if list(found) == [out_path]:
        return found[out_path]
    lines = "\n".join(f"{path} {md5}" for path, md5 in sorted(found.items()))
    return hashlib.md5(lines.encode()).hexdigest()


def lock_params(lock: Mapping[str, Any], stages: Iterable[str]) -> dict[str, str]:
    """The params each stage actually ran with, as dvc.lock recorded them, flattened."""
    out: dict[str, str] = {}
    for name in stages:
        for values in lock.get(name, {}).get("params", {}).values():
            out.update(flatten("", values))
    return out


def val_digest(manifest: Path, split: str = "val") -> str | None:
    """A digest of the evaluation set: sha256 over the split's shards' names and sha256s."""
    if not manifest.exists():
        return None
    shards = read_json(manifest).get("splits", {}).get(split, {}).get("shards", [])
    if not shards:
        return None
    lines = sorted(f"{s['name']}:{s['sha256']}" for s in shards)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:32]


def lineage(lock: Mapping[str, Any], manifest: Path) -> dict[str, str]:
    """Tags that say exactly what a run was made from: code, data and tokenizer versions
    (`lock`: dvc.lock's stages, `manifest`: the shard manifest)."""
    meta = lock.get("metadata", {}).get("params", {}).get("params.yaml", {}).get("metadata", {})
    source = str(meta.get("source", "unknown"))
    where = {"mscoco": meta.get("url"), "local": meta.get("path")}.get(source)
    tags = {
        "lineage.git_commit": (_git("rev-parse", "HEAD") or "").strip() or None,
        "lineage.git_dirty": _dirty(lock),
        "lineage.data_shards_md5": lock_hash(lock, "data/shards"),
        "lineage.tokenizer_md5": lock_hash(lock, "models/tokenizer.json"),
        "lineage.metadata_source": source,
        "lineage.metadata_location": where,
        "lineage.metadata_md5": lock_hash(lock, "data/metadata.parquet"),
        "lineage.metadata_sha256": meta.get("sha256"),
        "lineage.val_digest": val_digest(manifest),
    }
    if tags["lineage.git_commit"]:
        tags["mlflow.source.git.commit"] = tags["lineage.git_commit"]
    return safe_params({k: str(v) for k, v in tags.items() if v is not None})


def carried_over(what: str, uri: str, version_uri: str | None, run_id: str | None,
                 sha256: str | None) -> dict[str, str]:
    """Lineage tags of what a night took from a registered version (registry.carryover): `what`
    is "tokenizer" (tokenizer.pin) or "init" (train.init_from); `version_uri` None: nothing was
    registered yet, so nothing was taken (the first night)."""
    if version_uri is None:
        return {f"lineage.{what}_from": f"none: {uri} names no registered model yet (the first "
                                        "night)"}
    return {f"lineage.{what}_from": version_uri, f"lineage.{what}_from_uri": uri,
            f"lineage.{what}_from_run": run_id or "", f"lineage.{what}_sha256": sha256 or ""}


def dvc_experiment_tags() -> dict[str, str]:
    """The DVC experiment this run belongs to, when DVC says so (queued/temp experiments)."""
    names = {"DVC_EXP_NAME": "dvc.exp_name", "DVC_EXP_BASELINE_REV": "dvc.exp_baseline_rev"}
    return {tag: os.environ[env] for env, tag in names.items() if os.environ.get(env)}


# What makes a run's code or params differ from its commit: Python code, the params and the
# pipeline definition, the package's assets. Anything else that changed (dvc.lock, metrics/,
# plots/ - the pipeline's own writes - or a note) leaves the commit honest.
_LINEAGE_SUFFIXES = (".py",)
_LINEAGE_NAMES = ("params.yaml", "dvc.yaml", "pyproject.toml")
_LINEAGE_DIRS = ("clipms/",)


def status_paths(status: str) -> list[str]:
    """Every path named by `git status --porcelain -z` output: each entry is `XY path` (X and Y
    the index and work-tree states, a space for "unchanged": ` M params.yaml` is an unstaged
    edit), and a rename or copy is followed by its source path as an entry of its own. NUL
    separated and never quoted, so any file name reads back as it is."""
    entries = status.split("\0")
    paths, i = [], 0
    while i < len(entries):
        entry = entries[i]
        i += 1
        if len(entry) < 4:
            continue
        paths.append(entry[3:])
        if entry[0] in "RC":  # the source of a rename or copy changed too
            paths.append(entries[i])
            i += 1
    return paths


def changed_code_and_params(status: str, lock: Mapping[str, Any]) -> list[str]:
    """The paths of `git status --porcelain -z` output that change code or params (the
    pipeline's outputs, as dvc.lock records them, never count)."""
    outputs = {out.get("path", "") for stage in lock.values() for out in stage.get("outs", [])}
    changed = []
    for path in status_paths(status):
        if not path or path == "dvc.lock" or any(
                path == o or path.startswith(o.rstrip("/") + "/") for o in outputs if o):
            continue
        if (path.endswith(_LINEAGE_SUFFIXES) or Path(path).name in _LINEAGE_NAMES
                or path.startswith(_LINEAGE_DIRS)):
            changed.append(path)
    return changed


def _dirty(lock: Mapping[str, Any]) -> str | None:
    status = _git("status", "--porcelain", "-z", "--untracked-files=all")
    return None if status is None else str(bool(changed_code_and_params(status, lock))).lower()


def dataset_record(tags: Mapping[str, str], manifest: Path) -> dict[str, str] | None:
    """The shards as an MLflow dataset input: name, digest = DVC hash, source = their origin."""
    digest = tags.get("lineage.data_shards_md5")
    if not digest:
        return None
    source = tags.get("lineage.metadata_source", "unknown")
    location = tags.get("lineage.metadata_location")
    if source == "mscoco" and location:
        source_type, uri = "http", location
    elif source == "local" and location:
        source_type, uri = "local", location
    else:
        source_type, uri = "code", f"prep ({source} metadata)"
    splits = read_json(manifest).get("splits", {}) if manifest.exists() else {}
    profile = {name: split.get("samples") for name, split in splits.items()}
    return {"name": f"{source}-shards", "digest": digest[:36], "source_type": source_type,
            "source": json.dumps({"uri": uri}), "profile": json.dumps(profile)}


def data_change_metrics(report: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of the data-change report as `data.<section>.<name>` metrics (MLflow compares
    them across runs); lists (reasons, words) and flags stay in the report, logged as a file."""
    out: dict[str, float] = {}
    for section in DATA_CHANGE_SECTIONS:
        values = report.get(section)
        if not isinstance(values, Mapping):
            continue
        for name, value in values.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                out[f"data.{section}.{name}"] = float(value)
    return out
