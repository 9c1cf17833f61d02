"""The champion/challenger promotion gate: a pure decision, then registry aliases (never stages).

A new version becomes `champion` only if its primary metric beats the current champion's by at least
`margin` in the metric's own direction (higher-is-better like R@5, lower-is-better like mean rank;
strictly: a tie never replaces the champion), on the same evaluation set (same val-set digest, and
both known). When the champion was scored on another set (the data grew, so new images hashed
into val), the caller re-scores it on the new version's set first (`needs_rescore`,
`registry.rescore`) and hands `decide` that value; a version compared against a champion value of
another or an unknown set becomes `challenger` and the reason says why. The first version of a
model becomes champion. Every decision says which set both values are on and where each came from.

It fails closed: only "the model has no `champion` alias" leads to the first-version path. Any error
reading the registry (a locked database, a 5xx, a timeout) is a `GateError`, and no alias moves.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from clipms.eval.metrics import HIGHER, LOWER, metric_direction
from registry.versions import logged_model_id

CHAMPION, CHALLENGER = "champion", "challenger"


class GateError(RuntimeError):
    """The gate could not decide safely (the registry did not answer, or a bad primary metric)."""


# Where a value came from, when nobody says otherwise (the new version's: its evaluate stage).
EVALUATED_IN_THIS_RUN = "evaluate stage of this run"


@dataclass(frozen=True)
class Candidate:
    """A model version as the gate sees it."""

    version: str
    value: float | None  # the primary metric on its evaluation set
    val_digest: str | None  # which evaluation set produced `value`
    source: str = ""  # where `value` came from ("" = recorded when the version was registered)
    recorded: tuple[float | None, str | None] | None = None  # re-scored: (value, digest) before

    def origin(self) -> str:
        return self.source or f"recorded when v{self.version} was registered"


@dataclass(frozen=True)
class Decision:
    alias: str  # CHAMPION or CHALLENGER
    reason: str
    primary_metric: str
    direction: str  # HIGHER or LOWER: which way the primary metric improves
    margin: float
    new_value: float | None
    champion_value: float | None  # the champion's value before this decision (None: no champion)
    champion_version: str | None
    compared: bool  # False when there was nothing comparable to compare against
    eval_set: str | None = None  # the val digest of the set both values are on (when compared)
    eval_set_name: str | None = None  # what that set is (the evaluate stage's split, a pinned set)
    new_source: str | None = None  # where new_value came from
    champion_source: str | None = None  # where champion_value came from
    champion_recorded_value: float | None = None  # re-scored: the value the champion had before
    champion_recorded_set: str | None = None  # ... on this set (its own val digest)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def needs_rescore(new: Candidate, champion: Candidate | None) -> bool:
    """True when the champion has no value on the new version's evaluation set (it was scored on
    another or an unknown one, or not for this metric), and that set is known: the champion must
    be re-scored on it before the two can be compared."""
    if champion is None or not new.val_digest:
        return False
    return champion.val_digest != new.val_digest or champion.value is None


def rescored(champion: Candidate, value: float, val_digest: str, source: str) -> Candidate:
    """The champion as scored again on the set `val_digest`, remembering what it had before."""
    return Candidate(champion.version, value, val_digest, source,
                     recorded=(champion.value, champion.val_digest))


def primary_direction(primary_metric: str, metrics: Mapping[str, Any]) -> str:
    """The direction of `primary_metric`, which must be a model-quality metric that evaluate
    wrote; else a GateError naming the metrics allowed."""
    allowed = sorted(k for k, v in metrics.items()
                     if metric_direction(k) and isinstance(v, int | float)
                     and not isinstance(v, bool))
    direction = metric_direction(primary_metric)
    if primary_metric not in allowed or direction is None:
        why = ("is not in the evaluation metrics" if primary_metric not in metrics
               else "does not rank models (a count or a chance level)")
        raise GateError(f"register.primary_metric '{primary_metric}' {why}; allowed: "
                        + ", ".join(f"{k} ({metric_direction(k)} is better)" for k in allowed))
    return direction


def decide(new: Candidate, champion: Candidate | None, primary_metric: str,
           margin: float, direction: str = HIGHER, eval_set_name: str | None = None) -> Decision:
    """Champion or challenger for `new`, given the current champion (None if there is none);
    `eval_set_name` names the new version's evaluation set in the decision."""
    if margin < 0:
        raise ValueError(f"register.margin must be >= 0, got {margin}")
    if direction not in (HIGHER, LOWER):
        raise ValueError(f"direction must be {HIGHER!r} or {LOWER!r}, got {direction!r}")

    def result(alias: str, reason: str, compared: bool) -> Decision:
        recorded = champion.recorded if champion and champion.recorded else (None, None)
        return Decision(alias, reason, primary_metric, direction, margin, new.value,
                        champion.value if champion else None,
                        champion.version if champion else None, compared,
                        eval_set=new.val_digest if compared else None,
                        eval_set_name=eval_set_name, new_source=new.source or EVALUATED_IN_THIS_RUN,
                        champion_source=champion.origin() if champion else None,
                        champion_recorded_value=recorded[0], champion_recorded_set=recorded[1])

    if champion is None:
        return result(CHAMPION, "first version: there is no champion yet", False)
    if new.value is None:
        return result(CHALLENGER, f"this version has no '{primary_metric}' value", False)
    if not new.val_digest or not champion.val_digest:  # two unknown sets are not one set
        return result(CHALLENGER, (
            f"not compared: unknown evaluation set (no val digest on "
            f"{'this version' if not new.val_digest else ''}"
            f"{' and ' if not new.val_digest and not champion.val_digest else ''}"
            f"{f'champion v{champion.version}' if not champion.val_digest else ''})"), False)
    if new.val_digest != champion.val_digest:
        return result(CHALLENGER, (
            f"not compared: evaluated on a different evaluation set (val digest "
            f"{new.val_digest} vs champion v{champion.version}'s {champion.val_digest})"), False)
    if champion.value is None:
        return result(CHALLENGER, (
            f"not compared: champion v{champion.version} has no '{primary_metric}' value"), False)
    gain = new.value - champion.value if direction == HIGHER else champion.value - new.value
    better = "higher" if direction == HIGHER else "lower"
    where = _where(champion, new.val_digest, eval_set_name)
    if gain > 0 and gain >= margin:
        return result(CHAMPION, (
            f"{primary_metric} {new.value:.6g} beats champion v{champion.version}'s "
            f"{champion.value:.6g} ({better} is better) by {gain:.6g} >= margin {margin:g}"
            f"{where}"), True)
    return result(CHALLENGER, (
        f"{primary_metric} {new.value:.6g} does not beat champion v{champion.version}'s "
        f"{champion.value:.6g} ({better} is better) by more than 0 and at least margin "
        f"{margin:g} (gain {gain:.6g}){where}"), True)


def _where(champion: Candidate, digest: str, name: str | None) -> str:
    """"; both on evaluation set <name> <digest>", and how the champion got its value there."""
    named = f"{name} " if name else ""
    text = f"; both on evaluation set {named}{digest}"
    if champion.recorded is not None:
        value, old_set = champion.recorded
        before = "no value" if value is None else f"{value:.6g}"
        text += (f", the champion's value {champion.origin()} (it had {before} on "
                 f"{old_set or 'an unknown set'})")
    return text


def current_champion(mlflow_client: Any, name: str, primary_metric: str) -> Candidate | None:
    """The version holding alias `champion`, with its recorded metric and val digest.

    None only when the alias lookup says "not found" AND the registered model, read back, has no
    `champion` alias; any other outcome of either call is a GateError."""
    from mlflow.exceptions import MlflowException

    try:
        try:
            version = mlflow_client.get_model_version_by_alias(name, CHAMPION)
        except MlflowException as err:
            if err.error_code not in ("INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST"):
                raise
            if CHAMPION in (mlflow_client.get_registered_model(name).aliases or {}):
                raise  # the alias exists: "not found" was something else
            return None
        return candidate_from_version(version, primary_metric, mlflow_client)
    except Exception as err:  # a locked database, a 5xx, a timeout: never "no champion"
        raise GateError(f"could not read the current champion of '{name}' from the registry "
                        f"({first_line(err)}); no alias was moved") from err


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:300] if text else ''}"


def metric_tag(primary_metric: str) -> str:
    """The version tag holding the gate's input value (`metric.i2t_R_at_5`)."""
    from tracking.journal import mlflow_key

    return f"metric.{mlflow_key(primary_metric)}"


def logged_metrics(mlflow_client: Any, version: Any) -> dict[str, float]:
    """The metrics on the version's logged model (MLflow names; the last value of each), {} for a
    version without one. Registry errors propagate."""
    model_id = logged_model_id(version)
    if model_id is None:
        return {}
    return {m.key: float(m.value) for m in mlflow_client.get_logged_model(model_id).metrics or []}


def candidate_from_version(version: Any, primary_metric: str,
                           mlflow_client: Any | None = None) -> Candidate:
    """The version's value of `primary_metric`: its tag, else (a version registered while another
    metric was primary) the metric on its logged model, read through `mlflow_client`."""
    from tracking.journal import mlflow_key

    tags = version.tags or {}
    raw = tags.get(metric_tag(primary_metric))
    value = float(raw) if raw not in (None, "") else None
    if value is None and mlflow_client is not None:
        value = logged_metrics(mlflow_client, version).get(mlflow_key(primary_metric))
    return Candidate(str(version.version), value, tags.get("lineage.val_digest") or None)


def describe(decision: Decision) -> str:
    """The version's description in the registry: the gate's decision and why (the reason names
    the evaluation set and where the champion's value came from)."""
    value = "none" if decision.new_value is None else f"{decision.new_value:.6g}"
    return f"{decision.alias} ({decision.primary_metric} {value}): {decision.reason}"


def decided_alias(description: str | None) -> str | None:
    """The alias the gate decided, read back from a description `describe` wrote."""
    head = (description or "").split(" ", 1)[0]
    return head if head in (CHAMPION, CHALLENGER) else None


def apply(mlflow_client: Any, name: str, version: str, decision: Decision) -> None:
    """Record the decision as the version's description, then point the decided alias at it
    (the alias move comes last: if anything before it fails, no alias has moved)."""
    mlflow_client.update_model_version(name, version, description=describe(decision))
    mlflow_client.set_registered_model_alias(name, decision.alias, version)
