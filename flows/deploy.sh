#!/usr/bin/env bash
# Create the `process` work pool (if missing) and register the deployments of prefect.yaml.
# Run it from the checkout the worker should run the pipeline in (default: this script's project).
# Needs a reachable Prefect API (PREFECT_API_URL, e.g. http://127.0.0.1:4200/api).
set -euo pipefail
cd "${CLIPMS_WORKSPACE:-$(dirname "$0")/..}"
POOL=clipms   # must match work_pools.process_pool.name in prefect.yaml

if prefect work-pool inspect "$POOL" >/dev/null 2>&1; then
  echo "work pool '$POOL' exists"
else
  prefect work-pool create "$POOL" --type process
fi
prefect --no-prompt deploy --all
