"""Operating the pipeline on a host: the preflight and smoke checks, pinning an evaluation set,
the offline page of `dvc plots show`."""
