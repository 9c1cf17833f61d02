"""The MLflow pyfunc model of the exported CLIP bundle (MLflow "models from code").

MLflow copies this file into the logged model and runs it on load; the last line hands it the model
object, so nothing of ours is pickled. `load_context` opens the bundle artifact once (two MindIR
graphs + tokenizer.json + preprocess.json, through `clipms.infer.Encoder`); `predict` only computes.

Input: a DataFrame with a `text` column and/or an `image` column (base64-encoded JPEG/PNG, or a path
to an image file on the serving machine); a row may leave one of them empty. Output: a DataFrame
with `text_embedding` and/or `image_embedding` (L2-normalised float lists, None for empty inputs).
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pandas as pd
from mlflow.pyfunc import PythonModel

MAX_PATH_CHARS = 4096


def decode_image(value: Any, row: int) -> bytes | str:
    """Raw image bytes or a file path from one `image` cell; a clear error for anything else."""
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    if not isinstance(value, str):
        raise ValueError(f"image row {row}: expected base64 JPEG/PNG or a path, got "
                         f"{type(value).__name__}")
    if len(value) < MAX_PATH_CHARS and Path(value).is_file():
        return value
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"image row {row}: neither an existing file nor valid base64") from None


def _present(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and value != value)  # NaN = missing


class ClipEmbeddingModel(PythonModel):
    """Text and image embeddings from the exported MindIR towers."""

    def load_context(self, context: Any) -> None:
        from clipms.infer import Encoder

        self.encoder = Encoder(context.artifacts["bundle"])

    # `model_input: pd.DataFrame` is the one input hint MLflow 3 derives no schema from (the logged
    # signature stays the contract); without any hint it warns "Add type hints to the `predict`
    # method" every time this file runs: at each register, load and serve.
    def predict(self, context, model_input: pd.DataFrame, params=None):  # noqa: ANN001, ANN201
        frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
        columns = [c for c in ("text", "image") if c in frame.columns]
        if not columns:
            raise ValueError(
                f"input needs a 'text' and/or 'image' column, got {list(frame.columns)}")
        out = pd.DataFrame(index=frame.index)
        if "text" in columns:
            out["text_embedding"] = self._embed(frame["text"], self._texts)
        if "image" in columns:
            out["image_embedding"] = self._embed(frame["image"], self._images)
        return out.reset_index(drop=True)

    def _texts(self, values: list[Any]) -> Any:
        return self.encoder.encode_texts([str(v) for v in values])

    def _images(self, values: list[Any]) -> Any:
        return self.encoder.encode_images(values)

    @staticmethod
    def _embed(column: Any, encode: Any) -> list[list[float] | None]:
        """Encode the non-empty cells in one batch; empty cells give None."""
        rows = [i for i, v in enumerate(column.tolist()) if _present(v)]
        values = column.tolist()
        inputs = [values[i] for i in rows]
        if column.name == "image":
            inputs = [decode_image(v, i) for v, i in zip(inputs, rows, strict=True)]
        result: list[list[float] | None] = [None] * len(values)
        if rows:
            embeddings = np.asarray(encode(inputs), dtype=np.float32)
            # L2-normalise here whatever the encoder returns: cosine similarity is a dot product.
            embeddings /= np.maximum(np.linalg.norm(embeddings, axis=1, keepdims=True), 1e-12)
            for i, embedding in zip(rows, embeddings, strict=True):
                result[i] = [float(x) for x in embedding]
        return result


mlflow.models.set_model(ClipEmbeddingModel())
