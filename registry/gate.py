"""The champion/challenger promotion gate: a pure decision, then registry aliases (never stages).

A new version becomes `champion` only if its primary metric beats the current champion's by at least
`margin` (and strictly: a tie never replaces the champion) on the same evaluation set (same val-set
digest). A version evaluated on a different set is never compared with the champion: it becomes
`challenger` and the reason says why. The first version of a model becomes champion.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

CHAMPION, CHALLENGER = "champion", "challenger"


@dataclass(frozen=True)
class Candidate:
    """A model version as the gate sees it."""

    version: str
    value: float | None  # the primary metric on its evaluation set
    val_digest: str | None  # which evaluation set produced `value`


@dataclass(frozen=True)
class Decision:
    alias: str  # CHAMPION or CHALLENGER
    reason: str
    primary_metric: str
    margin: float
    new_value: float | None
    champion_value: float | None  # the champion's value before this decision (None: no champion)
    champion_version: str | None
    compared: bool  # False when there was nothing comparable to compare against

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def decide(new: Candidate, champion: Candidate | None, primary_metric: str,
           margin: float) -> Decision:
    """Champion or challenger for `new`, given the current champion (None if there is none)."""
    if margin < 0:
        raise ValueError(f"register.margin must be >= 0, got {margin}")

    def result(alias: str, reason: str, compared: bool) -> Decision:
        return Decision(alias, reason, primary_metric, margin, new.value,
                        champion.value if champion else None,
                        champion.version if champion else None, compared)

    if champion is None:
        return result(CHAMPION, "first version: there is no champion yet", False)
    if new.value is None:
        return result(CHALLENGER, f"this version has no '{primary_metric}' value", False)
    if not new.val_digest or new.val_digest != champion.val_digest:
        return result(CHALLENGER, (
            f"not compared: evaluated on a different evaluation set (val digest "
            f"{new.val_digest} vs champion v{champion.version}'s {champion.val_digest})"), False)
    if champion.value is None:
        return result(CHALLENGER, (
            f"not compared: champion v{champion.version} has no '{primary_metric}' value"), False)
    gain = new.value - champion.value
    if gain > 0 and gain >= margin:
        return result(CHAMPION, (
            f"{primary_metric} {new.value:.6g} beats champion v{champion.version}'s "
            f"{champion.value:.6g} by {gain:.6g} >= margin {margin:g}"), True)
    return result(CHALLENGER, (
        f"{primary_metric} {new.value:.6g} does not beat champion v{champion.version}'s "
        f"{champion.value:.6g} by more than 0 and at least margin {margin:g} "
        f"(difference {gain:.6g})"), True)


def current_champion(mlflow_client: Any, name: str, primary_metric: str) -> Candidate | None:
    """The version holding alias `champion`, with its recorded metric and val digest."""
    from mlflow.exceptions import MlflowException

    try:
        version = mlflow_client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        return None  # no such registered model or alias yet
    return candidate_from_version(version, primary_metric)


def candidate_from_version(version: Any, primary_metric: str) -> Candidate:
    tags = version.tags or {}
    from registry.journal import mlflow_key

    raw = tags.get(f"metric.{mlflow_key(primary_metric)}")
    return Candidate(str(version.version), float(raw) if raw not in (None, "") else None,
                     tags.get("lineage.val_digest"))


def apply(mlflow_client: Any, name: str, version: str, decision: Decision) -> None:
    """Point the decided alias at `version` and record the decision on the version."""
    mlflow_client.set_registered_model_alias(name, decision.alias, version)
    for key, value in decision_tags(decision).items():
        mlflow_client.set_model_version_tag(name, version, key, value)


def decision_tags(decision: Decision) -> dict[str, str]:
    return {f"gate.{k}": "" if v is None else str(v) for k, v in decision.to_dict().items()}
