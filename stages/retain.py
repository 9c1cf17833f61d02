"""Stage `retain`: apply the retention policy (`retention` in params.yaml, `registry.retention`)
at the end of every night, after the gate: older versions' checkpoint, bundle, index and plot
pictures leave the MLflow artifact store, and the DVC cache objects only they use leave the local
cache (after `dvc push` when a remote is configured), and, with `retention.prune_remote`, the
default DVC remote too. The champion, the challenger, the newest versions and those tagged to keep
stay whole; no version's registry entry, run, metrics or lineage is removed.

Writes `metrics/retain.json`: what was kept and removed, why, and how many bytes it freed.
`python -m registry retain --dry-run` shows the same plan without removing anything.
"""
# tested by: tests/integration/test_retention_store.py

from __future__ import annotations

import os
import sys
from pathlib import Path

from pipeline import paths
from pipeline.params import ParamsError

READS = (paths.REGISTER_METRICS,)  # after the gate: the versions and aliases it left
WRITES = (paths.RETAIN_METRICS,)


def temporary_copy(cwd: Path) -> bool:
    """Whether DVC runs this stage in a temporary copy of the project (`dvc exp run --temp`, a
    queued experiment): DVC_ROOT names the user's project, not `cwd`. There the copy's dvc.lock
    is not the project's and its remote's relative path points into the copy, so the shared DVC
    cache is left alone (the next `dvc repro` of the project applies it)."""
    root = os.environ.get("DVC_ROOT")
    return bool(root) and Path(root).resolve() != cwd.resolve()


def main() -> int:
    from registry.retention import RetentionError, retain, retention_params
    from tracking.settings import client, register_params

    try:
        params = retention_params(paths.PARAMS)
        model_name = register_params(paths.PARAMS).model_name
    except ParamsError as err:
        print(f"retain: error: {err}", file=sys.stderr)
        return 1
    from clipms.utils.jsonio import write_json

    try:  # DVC runs every stage in the project root
        report = retain(client(), model_name, params, Path("."),
                        dvc_cache=not temporary_copy(Path.cwd()))
    except RetentionError as err:
        print(f"retain: error: {err}", file=sys.stderr)
        return 1
    write_json(paths.RETAIN_METRICS, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
