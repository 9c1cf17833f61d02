"""Stage `register`: log the export bundle as a pyfunc into the pipeline's MLflow run, register a
new version of `register.model_name`, and let the champion/challenger gate pick its alias.

Writes `metrics/register.json` (version, decision, both numbers, reason). Needs the tracking server:
when it is unreachable this stage fails with a message naming it; nothing upstream is lost.
"""

from __future__ import annotations

import sys

from pipeline.params import ParamsError
from stages import paths

READS = (paths.BUNDLE, paths.INDEX, paths.MLFLOW_RUN, paths.EVAL_METRICS, paths.MANIFEST)
WRITES = (paths.REGISTER_METRICS,)


def main() -> int:
    from registry.settings import register_params

    try:
        params = register_params(paths.PARAMS)
    except ParamsError as err:
        print(f"register: error: {err}", file=sys.stderr)
        return 1
    from clipms.utils.jsonio import read_json, write_json
    from registry.gate import GateError
    from registry.gatelock import GateLockTimeout
    from registry.lineage import flatten
    from registry.registration import RegistryError, register_version
    from registry.run import PipelineRun, TrackingUnavailable
    from stages.tracking import FILES

    try:
        run = PipelineRun.resume(FILES)
    except FileNotFoundError as err:  # train ran without tracking: the model still gets a run
        print(f"register: {err}; opening a run here", file=sys.stderr)
        run = PipelineRun.open("register", {}, FILES, owns_run_file=False)
    run.log_params(flatten("register", params.model_dump()))
    try:
        # The index is logged into the version's model (a test workspace may have none).
        record = register_version(run, paths.BUNDLE, params, read_json(paths.EVAL_METRICS),
                                  index_dir=paths.INDEX if paths.INDEX.is_dir() else None)
    except TrackingUnavailable as err:  # the journal keeps everything for the next attempt
        print(f"register: error: {err}", file=sys.stderr)
        return 1
    except (GateError, GateLockTimeout, RegistryError) as err:  # failed closed: no alias moved
        print(f"register: error: {err}", file=sys.stderr)
        run.fail(err)
        return 1
    write_json(paths.REGISTER_METRICS, record)
    run.close()
    print(f"register: {params.model_name} v{record['version']} -> {record['alias']} "
          f"({record['reason']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
