"""The MLflow pyfunc model of the exported CLIP bundle (MLflow "models from code").

MLflow copies this file into the logged model and runs it on load; the last line hands it the model
object, so nothing of ours is pickled. `load_context` opens the bundle artifact once (two MindIR
graphs + tokenizer.json + preprocess.json, through `clipms.deploy.infer.Encoder`); `predict` only
computes.

Input: a DataFrame with a `text` column and/or an `image` column (base64-encoded JPEG, PNG or WEBP);
a row may leave one of them empty. Output: a DataFrame with `text_embedding` and/or
`image_embedding` (L2-normalised float lists, None for empty inputs).

The served model reads no file of its host: an image is only ever base64 (or raw bytes from a Python
caller), so a string naming a path is refused like any other bad input. Every bad input - not
base64, not an allowed format, over the bundle's pixel limit, a request over the row or byte limit
(`clipms.deploy.inputs.RequestLimits`; `CLIPMS_SERVE_MAX_ROWS` / `CLIPMS_SERVE_MAX_BYTES` in the
serving process's environment raise them) - is an MLflow INVALID_PARAMETER_VALUE (HTTP 400) whose
message names the row and what is allowed, with no stack trace. Any other failure is an
INTERNAL_ERROR (HTTP 500) without details; the traceback goes to the server's log only.
"""

# tested by: tests/registry/test_gate.py

from __future__ import annotations

import logging
import os
from typing import Any

import mlflow
import numpy as np
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INTERNAL_ERROR, INVALID_PARAMETER_VALUE
from mlflow.pyfunc import PythonModel

log = logging.getLogger(__name__)
LIMIT_VARIABLES = {"max_rows": "CLIPMS_SERVE_MAX_ROWS", "max_bytes": "CLIPMS_SERVE_MAX_BYTES"}


def request_limits(environ: dict[str, str] | None = None) -> Any:
    """The limits of this serving process: RequestLimits' defaults, or the environment's."""
    from clipms.deploy.inputs import RequestLimits

    environ = os.environ if environ is None else environ
    values = {}
    for field, variable in LIMIT_VARIABLES.items():
        if environ.get(variable):
            try:
                values[field] = int(environ[variable])
            except ValueError:
                raise ValueError(f"{variable}={environ[variable]!r}: expected an integer") from None
    return RequestLimits(**values)


class ClientInputError(MlflowException):
    """An INVALID_PARAMETER_VALUE whose message, once made, stays as it is. MLflow's scoring
    server rewrites the message of any MlflowException raised by predict as "Failed to predict
    data '<the request's DataFrame>'. Error: <message>": the answer would repeat what the client
    sent (a path, a token in a caption, 50 characters of every cell), which no message here does
    (clipms.deploy.inputs)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, error_code=INVALID_PARAMETER_VALUE)

    @property
    def message(self) -> str:
        return self._message

    @message.setter
    def message(self, value: str) -> None:
        if not hasattr(self, "_message"):  # set by MlflowException.__init__; never rewritten
            self._message = value


def client_error(message: str) -> MlflowException:
    return ClientInputError(message)


def _present(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and value != value)  # NaN = missing


class ClipEmbeddingModel(PythonModel):
    """Text and image embeddings from the exported MindIR towers."""

    def load_context(self, context: Any) -> None:
        from clipms.deploy.infer import Encoder

        self.encoder = Encoder(context.artifacts["bundle"])  # registry.pyfunc.BUNDLE_ARTIFACT
        self.limits = request_limits()

    # `model_input: pd.DataFrame` is the one input hint MLflow 3 derives no schema from (the logged
    # signature stays the contract); without any hint it warns "Add type hints to the `predict`
    # method" every time this file runs: at each register, load and serve.
    def predict(self, context, model_input: pd.DataFrame, params=None):  # noqa: ANN001, ANN201
        from clipms.data.preprocess import PreprocessError
        from clipms.deploy.inputs import InputError

        try:
            return self._predict(model_input)
        except (InputError, PreprocessError) as err:
            raise client_error(str(err)) from None
        except MlflowException:
            raise
        except Exception:
            log.exception("clip pyfunc: predict failed")
            raise MlflowException("internal error while computing embeddings (see the server "
                                  "log)", error_code=INTERNAL_ERROR) from None

    def _predict(self, model_input: Any) -> Any:
        frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
        columns = [c for c in ("text", "image") if c in frame.columns]
        if not columns:
            raise client_error("input needs a 'text' and/or 'image' column, got "
                               f"{len(frame.columns)} other column(s)")
        texts = frame["text"].tolist() if "text" in columns else []
        images = frame["image"].tolist() if "image" in columns else []
        self.limits.check([str(t) for t in texts if _present(t)],
                          [i for i in images if _present(i)], rows=len(frame))
        out = pd.DataFrame(index=frame.index)
        if "text" in columns:
            out["text_embedding"] = self._embed(texts, self._texts)
        if "image" in columns:
            out["image_embedding"] = self._embed(images, self._images)
        return out.reset_index(drop=True)

    def _texts(self, rows: list[int], values: list[Any]) -> np.ndarray:
        return self.encoder.encode_texts([str(v) for v in values])

    def _images(self, rows: list[int], values: list[Any]) -> np.ndarray:
        from clipms.data.preprocess import preprocess_image
        from clipms.deploy.inputs import image_bytes

        arrays = [preprocess_image(image_bytes(value, f"image row {row}"),
                                   self.encoder.preprocess, name=f"image row {row}")
                  for row, value in zip(rows, values, strict=True)]
        return self.encoder.encode_preprocessed(np.stack(arrays))

    @staticmethod
    def _embed(values: list[Any], encode: Any) -> list[list[float] | None]:
        """Encode the non-empty cells in one batch; empty cells give None."""
        rows = [i for i, v in enumerate(values) if _present(v)]
        result: list[list[float] | None] = [None] * len(values)
        if rows:
            embeddings = np.asarray(encode(rows, [values[i] for i in rows]), dtype=np.float32)
            # L2-normalise here whatever the encoder returns: cosine similarity is a dot product.
            embeddings /= np.maximum(np.linalg.norm(embeddings, axis=1, keepdims=True), 1e-12)
            for i, embedding in zip(rows, embeddings, strict=True):
                result[i] = [float(x) for x in embedding]
        return result


mlflow.models.set_model(ClipEmbeddingModel())
