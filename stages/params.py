"""The stages' params loader: `clipms.params` (moved there so `registry/` can read params.yaml
through the same typed loader without importing `stages/`). Re-exported for the stages."""

from clipms.params import (
    PARAMS_FILE,
    ParamsError,
    Section,
    load_section,
    read_params,
    validate_section,
)

__all__ = ["PARAMS_FILE", "ParamsError", "Section", "load_section", "read_params",
           "validate_section"]
