"""What a night takes from a registered version, usually the champion: its tokenizer
(`tokenizer.pin`) and its trained weights (`train.init_from: models:/clip@champion`).

The stages hand the library only local files: the version's tokenizer.json, copied byte for byte
to `models/tokenizer.json`, and its checkpoint, downloaded into a folder named by the checkpoint's
sha256 (so the train stage's resume fingerprint, which holds the `init_from` path, changes exactly
when the weights do). The library never sees a registry URI.

The first night is the one exception to failing closed: a registered model that does not exist at
all (no version was ever registered) means there is nothing to carry over, so the tokenizer is
built and training starts cold, and the lineage says so. Anything else - the model exists but the
alias or version does not, the version has no checkpoint logged, the checkpoint was trained with
another tokenizer or is another architecture, the registry does not answer - is a
`CarryOverError` and the stage stops before it writes or trains anything.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from registry.versions import (
    NoRegisteredModel,
    Version,
    VersionError,
    download_checkpoint,
    download_tokenizer,
    resolve,
)


class CarryOverError(RuntimeError):
    """Nothing may be carried over from the version asked for; the message says why."""


@dataclass(frozen=True)
class CarriedOver:
    """What a stage took from the registry (`version` None: the first night, nothing existed)."""

    uri: str  # as the params give it, e.g. models:/clip@champion
    version: Version | None
    path: Path | None  # the local file (tokenizer.json or clip.ckpt); None on the first night
    sha256: str | None

    def lineage(self, what: str) -> dict[str, str]:
        """Tags for the MLflow run (`what`: "tokenizer" or "init"), copied onto the version."""
        from tracking.lineage import carried_over

        version = self.version
        return carried_over(what, self.uri, version.fixed_uri if version else None,
                            version.run_id if version else None, self.sha256)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _resolve(uri: str, key: str) -> tuple[Any, Version | None]:
    """(client, version), or (client, None) when the model was never registered."""
    from tracking.settings import client

    mlflow_client = client()
    try:
        return mlflow_client, resolve(mlflow_client, uri)
    except NoRegisteredModel:
        return mlflow_client, None
    except VersionError as err:
        raise CarryOverError(f"{key}: {err}") from None
    except Exception as err:  # the registry did not answer: never "nothing to carry over"
        raise CarryOverError(f"{key}: could not read {uri} from the registry "
                             f"({type(err).__name__}: {str(err).strip()[:300]})") from err


def pin_tokenizer(uri: str, dst: Path) -> CarriedOver:
    """Copy the tokenizer.json of the version `uri` names to `dst`, byte for byte."""
    mlflow_client, version = _resolve(uri, "tokenizer.pin")
    if version is None:
        return CarriedOver(uri, None, None, None)
    with tempfile.TemporaryDirectory(prefix="clipms-tokenizer-") as tmp:
        try:
            fetched = download_tokenizer(mlflow_client, version, tmp)
        except Exception as err:
            raise CarryOverError(f"tokenizer.pin: could not download the tokenizer of "
                                 f"{version.fixed_uri} ({type(err).__name__}: "
                                 f"{str(err).strip()[:300]})") from err
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(fetched, dst)
    return CarriedOver(uri, version, dst, sha256_of(dst))


def fetch_init_checkpoint(uri: str, folder: Path, tokenizer: Path,
                          model: Mapping[str, Any]) -> CarriedOver:
    """The trained weights of the version `uri` names, in `folder/<sha256[:16]>/clip.ckpt` (other
    copies in `folder` are removed: the registry keeps them). They must have been trained with
    this `tokenizer` file and be this `model` architecture (a CLIPConfig dict)."""
    mlflow_client, version = _resolve(uri, "train.init_from")
    if version is None:
        return CarriedOver(uri, None, None, None)
    with tempfile.TemporaryDirectory(prefix="clipms-init-") as tmp:
        try:
            files = download_checkpoint(mlflow_client, version, Path(tmp) / "checkpoint")
        except VersionError as err:
            raise CarryOverError(f"train.init_from: {err}") from None
        except Exception as err:
            raise CarryOverError(f"train.init_from: could not download the checkpoint of "
                                 f"{version.fixed_uri} ({type(err).__name__}: "
                                 f"{str(err).strip()[:300]})") from err
        _check_same_tokenizer(uri, version, files.tokenizer, tokenizer)
        _check_same_model(uri, version, files.run_config, model)
        digest = sha256_of(files.checkpoint)
        kept = folder / digest[:16] / "clip.ckpt"
        _keep_only(folder, kept.parent.name)
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(files.checkpoint, kept)
    return CarriedOver(uri, version, kept, digest)


def _keep_only(folder: Path, name: str) -> None:
    """Remove the other copies in `folder`: downloads of registered checkpoints, which the
    registry keeps (nothing trained is lost)."""
    if not folder.is_dir():
        return
    for old in folder.iterdir():
        if old.name != name:
            shutil.rmtree(old) if old.is_dir() else old.unlink()


def _check_same_tokenizer(uri: str, version: Version, theirs: Path, ours: Path) -> None:
    if sha256_of(theirs) != sha256_of(ours):
        raise CarryOverError(
            f"train.init_from: {uri} ({version.fixed_uri}) was trained with another tokenizer "
            f"than {ours} (its token ids mean other words): set tokenizer.pin: {uri} so this "
            "night tokenizes as it did, or train cold (train.init_from: null)")


def _check_same_model(uri: str, version: Version, run_config: Path,
                      model: Mapping[str, Any]) -> None:
    import json

    from clipms.utils.jsonio import read_json

    theirs = read_json(run_config).get("model", {})
    differ = _differences(theirs, json.loads(json.dumps(dict(model))))  # tuples as JSON lists
    if differ:
        raise CarryOverError(
            f"train.init_from: {uri} ({version.fixed_uri}) is another architecture than "
            f"train.preset/train.model and the tokenizer give: {', '.join(differ[:8])}")


def _differences(theirs: dict[str, Any], ours: dict[str, Any], prefix: str = "") -> list[str]:
    """'key: theirs != ours' for every leaf that differs."""
    out = []
    for key in sorted(set(theirs) | set(ours)):
        a, b = theirs.get(key), ours.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} (theirs) != {b!r}")
    return out
