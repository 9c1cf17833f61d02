"""Stage `register`: log the export bundle as a pyfunc into the pipeline's MLflow run, register a
new version of `register.model_name`, and let the champion/challenger gate pick its alias.

Writes `metrics/register.json` (version, decision, both numbers, reason). Needs the tracking server:
when it is unreachable this stage fails with a message naming it; nothing upstream is lost.
"""

from __future__ import annotations

import sys
from pathlib import Path

from stages.params import ParamsError

EVAL_METRICS = Path("metrics/eval.json")
BUNDLE_DIR = Path("models/export")
INDEX_DIR = Path("models/index")  # the index stage's output, logged with the version's run
OUT = Path("metrics/register.json")


def main() -> int:
    from registry.settings import register_params

    try:
        params = register_params()
    except ParamsError as err:
        print(f"register: error: {err}", file=sys.stderr)
        return 1
    from clipms.jsonio import read_json, write_json
    from registry.lineage import flatten
    from registry.registration import register_version
    from registry.run import PipelineRun, TrackingUnavailable

    try:
        run = PipelineRun.resume()
    except FileNotFoundError as err:  # train ran without tracking: the model still gets a run
        print(f"register: {err}; opening a run here", file=sys.stderr)
        run = PipelineRun.open("register", {}, run_file=None)
    run.log_params(flatten("register", params.model_dump()))
    try:
        record = register_version(run, BUNDLE_DIR, params.model_name, params.primary_metric,
                                  params.margin, read_json(EVAL_METRICS),
                                  index_dir=INDEX_DIR if INDEX_DIR.is_dir() else None)
    except TrackingUnavailable as err:
        print(f"register: {err}", file=sys.stderr)
        return 1
    write_json(OUT, record)
    run.close()
    print(f"register: {params.model_name} v{record['version']} -> {record['alias']} "
          f"({record['reason']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
