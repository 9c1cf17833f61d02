"""Stage `register`: log the export bundle as a pyfunc into the pipeline's MLflow run (with the
checkpoint it was exported from), register a new version of `register.model_name`, and let the
champion/challenger gate pick its alias.

Writes `metrics/register.json` (version, decision, both numbers, the evaluation set and where each
number came from, reason). The gate compares both versions on the evaluation set `evaluate` used
(the `evaluate` section says which): a champion scored on another set is re-scored on it first.
Needs the tracking server: when it is unreachable this stage fails with a message naming it;
nothing upstream is lost.
"""

# tested by: tests/integration/test_registry_postgres.py

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from pipeline import paths
from pipeline.params import ParamsError, load_section

if TYPE_CHECKING:
    from clipms.eval.options import EvaluateParams
    from registry.rescore import EvaluationSet

READS = (paths.BUNDLE, paths.INDEX, paths.MLFLOW_RUN, paths.EVAL_METRICS, paths.MANIFEST,
         paths.SHARDS_VAL, paths.CHECKPOINT, paths.RUN_CONFIG, paths.TOKENIZER)
WRITES = (paths.REGISTER_METRICS,)


def evaluation_set(params: EvaluateParams) -> EvaluationSet:
    """The set `evaluate` scored this version on, as the gate re-scores a champion on it."""
    from registry.rescore import EvaluationSet
    from tracking.lineage import val_digest

    shards, split, name = paths.evaluation_set(params.split, params.pinned_set)
    if params.pinned_set:  # a frozen set must be the one recorded, shard for shard
        from clipms.data.evalset import verify

        verify(shards)
    return EvaluationSet(shards, split, val_digest(shards / "manifest.json", split), name,
                         params.zeroshot_spec(), params.batch_size)


def main() -> int:
    from clipms.data.webds import DataError
    from clipms.eval.options import EvaluateParams
    from tracking.settings import register_params

    try:
        params = register_params(paths.PARAMS)
        evaluated_on = evaluation_set(load_section("evaluate", EvaluateParams))
    except (ParamsError, DataError) as err:
        print(f"register: error: {err}", file=sys.stderr)
        return 1
    from clipms.utils.jsonio import read_json, write_json
    from registry.gate import GateError
    from registry.gatelock import GateLockTimeout
    from registry.registration import RegistryError, register_version
    from tracking.files import FILES
    from tracking.lineage import flatten
    from tracking.run import PipelineRun, TrackingUnavailable

    try:
        run = PipelineRun.resume(FILES)
    except FileNotFoundError as err:  # train ran without tracking: the model still gets a run
        print(f"register: {err}; opening a run here", file=sys.stderr)
        run = PipelineRun.open("register", {}, FILES, owns_run_file=False)
    run.log_params(flatten("register", params.model_dump()))
    try:
        # The index is logged into the version's model (a test workspace may have none).
        record = register_version(run, paths.BUNDLE, params, read_json(paths.EVAL_METRICS),
                                  index_dir=paths.INDEX if paths.INDEX.is_dir() else None,
                                  evaluation_set=evaluated_on,
                                  checkpoint_files=(paths.CHECKPOINT, paths.RUN_CONFIG,
                                                    paths.TOKENIZER))
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
