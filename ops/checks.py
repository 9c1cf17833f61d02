"""What a preflight or smoke check reports: a name, a status and one line of detail."""

# tested by: tests/ops/test_smoke.py

from __future__ import annotations

from dataclasses import dataclass

OK, WARN, FAIL = "ok", "warn", "FAIL"


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # OK | WARN | FAIL
    detail: str
