"""Packages img2dataset imports in every process but the download stage rarely uses, imported
only when first used.

img2dataset 1.47 imports `wandb` (its logger, used only with `enable_wandb`, which the stage
never sets) and `albumentations` (its resizer, used only where images are resized: the worker
processes) at import time, in the stage's own process and in each process it spawns (the logger
process and every multiprocessing worker): a large share of the fixed cost of a night that
fetches a few new images (docs/data-pipeline.md, "Measurements behind the code"). `defer()` puts
a stand-in module under each name; the first attribute read from it imports the real package, so
code that uses one gets the same package and the same results, later.

`importlib.util.LazyLoader` is not enough: `import wandb` itself reads the module's `__spec__`,
which makes a lazy module load at once.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any

DEFERRED = ("wandb", "albumentations")


class DeferredModule(types.ModuleType):
    """Stands under a package's name in sys.modules until an attribute is read from it; then
    the real package replaces it there and answers that read (and every later one)."""

    def __getattr__(self, attr: str) -> Any:  # only for what the stand-in does not hold
        return getattr(load(self.__name__), attr)


def load(name: str) -> types.ModuleType:
    """The real package `name`, imported now if a stand-in held its place."""
    held = sys.modules.get(name)
    if not isinstance(held, DeferredModule):
        return importlib.import_module(name)
    del sys.modules[name]
    try:
        return importlib.import_module(name)
    except BaseException:
        sys.modules[name] = held
        raise


def defer(names: tuple[str, ...] = DEFERRED) -> list[str]:
    """Put a stand-in under each installed package of `names` not imported yet; the names that
    got one. The stand-in carries the package's spec, so `importlib.util.find_spec` still
    answers for it."""
    deferred = []
    for name in names:
        if name in sys.modules:
            continue
        spec = importlib.util.find_spec(name)
        if spec is None:
            continue  # not installed: importing it fails as it would have
        module = DeferredModule(name)
        module.__spec__ = spec
        sys.modules[name] = module
        deferred.append(name)
    return deferred
