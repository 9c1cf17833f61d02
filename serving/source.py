"""Where the served model comes from: a local bundle + index, or the MLflow registry.

`models:/NAME@ALIAS` (or `models:/NAME/VERSION`) resolves to a model version; its logged model holds
the export bundle (the pyfunc's artifacts) and the index the `register` stage logged into it
(registry.index_store.INDEX_ARTIFACT), so one download of the version's own model brings both,
into a folder of its own per version: any machine serves the champion from MLflow alone, and
another version registered from the same run cannot change this version's index.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from registry.versions import MODEL_URI, bundle_folder
from serving.engine import ModelInfo

__all__ = ["MODEL_URI", "Fetched", "RegistrySource", "SourceError", "bundle_folder",
           "local_model"]


class SourceError(RuntimeError):
    """The version has no bundle or no index: it can never be served (not a transient error)."""


@dataclass
class Fetched:
    """A model version on local disk; `cleanup()` removes what was downloaded for it."""

    info: ModelInfo
    bundle_dir: Path
    index_dir: Path
    download_dir: Path | None = None

    def cleanup(self) -> None:
        if self.download_dir is not None:
            shutil.rmtree(self.download_dir, ignore_errors=True)


def local_model(bundle_dir: Path | str, index_dir: Path | str | None = None) -> Fetched:
    """A bundle folder (models/export) and its index (default: the sibling models/index)."""
    from clipms.deploy.searchindex import bundle_digest

    bundle = Path(bundle_dir)
    index = Path(index_dir) if index_dir is not None else bundle.parent / "index"
    info = ModelInfo(name=f"local:{bundle.name}", version=bundle_digest(bundle)[:12])
    return Fetched(info, bundle, index)


class RegistrySource:
    """A registered model, by alias (followed) or by version number (fixed)."""

    def __init__(self, uri: str, tracking_uri: str | None = None,
                 cache_dir: Path | str | None = None) -> None:
        match = MODEL_URI.match(uri)
        if match is None:
            raise SourceError(f"{uri!r}: expected models:/NAME@ALIAS or models:/NAME/VERSION")
        self.uri = uri
        self.name = match["name"]
        self.alias = match["alias"]
        self.fixed_version = match["version"]
        self.tracking_uri = tracking_uri
        self.cache_dir = Path(cache_dir) if cache_dir else None

    def _client(self):  # noqa: ANN202 - mlflow is imported lazily
        from tracking.settings import client

        return client(self.tracking_uri)

    def current(self) -> tuple[str, str | None]:
        """(version, run_id) the URI names now (the alias may have moved since the last call)."""
        client = self._client()
        if self.alias is None:
            version = client.get_model_version(self.name, self.fixed_version)
        else:
            version = client.get_model_version_by_alias(self.name, self.alias)
        return str(version.version), version.run_id

    def fetch(self, version: str, run_id: str | None) -> Fetched:
        """Download version `version`'s model (its bundle and its index) into a new folder."""
        import mlflow

        from clipms.deploy.searchindex import INDEX_JSON
        from registry.index_store import INDEX_ARTIFACT, IndexStoreError, materialize

        if self.cache_dir is not None:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix=f"clipms-serve-{self.name}-v{version}-",
                                       dir=self.cache_dir))
        info = ModelInfo(self.name, version, self.alias, run_id)
        try:
            uri = self.tracking_uri or None
            model = Path(mlflow.artifacts.download_artifacts(
                f"models:/{self.name}/{version}", dst_path=str(folder / "model"),
                tracking_uri=uri))
            bundle = bundle_folder(model)
            if bundle is None or not (bundle / "bundle.json").is_file():
                raise SourceError(f"{self.name} v{version}: no export bundle in the model's "
                                  "artifacts (not logged by registry.pyfunc?)")
            index = model / INDEX_ARTIFACT
            if index.is_dir():  # its files from the index store, by the reference logged
                try:
                    materialize(index, uri)
                except IndexStoreError as err:
                    raise SourceError(f"{self.name} v{version}: {err}") from err
            if not (index / INDEX_JSON).is_file():  # not the run's: the version's own index
                raise SourceError(f"{self.name} v{version}: its model has no "
                                  f"'{INDEX_ARTIFACT}' artifact (registered without an index?)")
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return Fetched(info, bundle, index, folder)
