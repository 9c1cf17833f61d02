"""`python -m registry compare`: the registered versions side by side, as the MLflow UI shows them.

One table per concern: versions with their aliases, key metrics and lineage; then only the params
that differ between versions (identical params are noise when comparing).
"""

# tested by: tests/registry/test_gate.py

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from registry.gate import decided_alias, logged_metrics
from tracking.journal import mlflow_key

DEFAULT_METRICS = ("i2t_R@1", "i2t_R@5", "t2i_R@1", "t2i_R@5", "mAP@10", "zeroshot_top1")


@dataclass
class VersionRow:
    version: int
    aliases: list[str]
    run_id: str
    tags: dict[str, str]
    params: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)  # its logged model's, MLflow names
    description: str = ""  # the gate's decision

    @property
    def decision(self) -> str:
        return decided_alias(self.description) or self.tags.get("gate.alias", "-")

    @property
    def reason(self) -> str | None:
        return self.description or self.tags.get("gate.reason")


def collect(mlflow_client: Any, name: str, limit: int = 20) -> list[VersionRow]:
    """The newest `limit` versions of `name`, with their run's params and their logged model's
    metrics."""
    versions = mlflow_client.search_model_versions(f"name = '{name}'")
    versions = sorted(versions, key=lambda v: int(v.version))[-limit:]
    aliases = _aliases(mlflow_client, name) if versions else {}
    rows = []
    for v in versions:
        params: dict[str, str] = {}
        if v.run_id:
            try:
                params = dict(mlflow_client.get_run(v.run_id).data.params)
            except Exception:  # the run may have been deleted; the version still lists
                params = {}
        rows.append(VersionRow(int(v.version), aliases.get(str(v.version), []),
                               v.run_id or "", dict(v.tags or {}), params,
                               _model_metrics(mlflow_client, v), v.description or ""))
    return rows


def _model_metrics(mlflow_client: Any, version: Any) -> dict[str, float]:
    try:
        return logged_metrics(mlflow_client, version)
    except Exception:  # the model may have been deleted; the version still lists
        return {}


def _aliases(mlflow_client: Any, name: str) -> dict[str, list[str]]:
    """{version: [aliases]} from the registered model (search results do not carry aliases)."""
    by_version: dict[str, list[str]] = {}
    for alias, version in (mlflow_client.get_registered_model(name).aliases or {}).items():
        by_version.setdefault(str(version), []).append(alias)
    return {v: sorted(a) for v, a in by_version.items()}


def differing_params(rows: Sequence[VersionRow]) -> list[str]:
    keys = sorted({k for row in rows for k in row.params})
    return [k for k in keys if len({row.params.get(k) for row in rows}) > 1]


def _short(value: str | None, n: int = 8) -> str:
    return (value or "-")[:n]


def _metric(row: VersionRow, key: str) -> str:
    raw = row.metrics.get(mlflow_key(key), row.tags.get(f"metric.{mlflow_key(key)}"))
    return "-" if raw in (None, "") else f"{float(raw):.4f}"


def format_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *body, strict=False)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=False)).rstrip()
             for r in [header, ["-" * w for w in widths], *body]]
    return "\n".join(lines)


def render(name: str, rows: Sequence[VersionRow], metrics: Sequence[str] = DEFAULT_METRICS) -> str:
    if not rows:
        return f"registered model '{name}': no versions"
    header = ["version", "aliases", "run", *metrics, "val_digest", "data_md5", "tokenizer",
              "git", "decision"]
    body = []
    for row in rows:
        dirty = "+dirty" if row.tags.get("lineage.git_dirty") == "true" else ""
        body.append([
            f"v{row.version}", ",".join(row.aliases) or "-", _short(row.run_id),
            *(_metric(row, m) for m in metrics),
            _short(row.tags.get("lineage.val_digest")),
            _short(row.tags.get("lineage.data_shards_md5")),
            _short(row.tags.get("lineage.tokenizer_md5")),
            _short(row.tags.get("lineage.git_commit"), 7) + dirty,
            row.decision])
    out = [f"registered model '{name}': {len(rows)} version(s)", format_table(header, body)]
    keys = differing_params(rows)
    if keys:
        out += ["", "params that differ:", format_table(
            ["param", *(f"v{r.version}" for r in rows)],
            [[k, *(r.params.get(k, "-") for r in rows)] for k in keys])]
    else:
        out += ["", "params: identical across these versions"]
    reasons = [f"  v{r.version}: {r.reason}" for r in rows if r.reason]
    if reasons:
        out += ["", "gate decisions:", *reasons]
    return "\n".join(out)
