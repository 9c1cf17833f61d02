"""The served pyfunc's 400s say what is wrong without repeating the request, through MLflow's own
scoring function (`mlflow.pyfunc.scoring_server.invocations`, what `mlflow models serve` runs per
request) in this process. The inputs here are refused before the model computes anything, so the
model needs no bundle (tests/registry/test_pyfunc.py serves a real one, slow)."""

from __future__ import annotations

import json

import pytest
from mlflow.exceptions import MlflowException
from mlflow.models import Model
from mlflow.pyfunc import PyFuncModel, scoring_server
from mlflow.pyfunc.model import _PythonModelPyfuncWrapper

from clipms.deploy.inputs import RequestLimits
from registry.pyfunc import signature
from registry.pyfunc_model import ClipEmbeddingModel

SECRET = "S3cret-token-in-a-cell"


@pytest.fixture(scope="module")
def served() -> PyFuncModel:
    model = ClipEmbeddingModel()
    model.limits = RequestLimits(max_rows=4)  # what load_context sets, without a bundle
    return PyFuncModel(model_meta=Model(signature=signature()),
                       model_impl=_PythonModelPyfuncWrapper(model, None, signature()))


@pytest.mark.parametrize(("columns", "rows", "message"), [
    (["image"], [[f"/home/{SECRET}/id_rsa"]], "image row 0: not valid base64; images are "
                                              "accepted only as base64-encoded JPEG, PNG or WEBP "
                                              "bytes"),
    (["image"], [[f"data:image/png;base64,{SECRET}!"]], "image row 0: not valid base64; images "
                                                         "are accepted only as base64-encoded "
                                                         "JPEG, PNG or WEBP bytes"),
    (["text"], [[SECRET]] * 5, "5 rows in one request, over the limit of 4"),
    (["caption"], [[SECRET]], "input needs a 'text' and/or 'image' column, got 0 other "
                              "column(s)"),  # the signature drops unknown columns first
], ids=["a path", "a data URL", "too many rows", "no known column"])
def test_a_400_says_what_is_wrong_and_never_repeats_the_request(served, columns, rows,
                                                                 message) -> None:
    """MLflow's scoring server rewrote each message as "Failed to predict data '<the frame>'":
    the answer quoted every cell it was sent."""
    body = json.dumps({"dataframe_split": {"columns": columns, "data": rows}})
    with pytest.raises(MlflowException) as caught:
        scoring_server.invocations(body, "application/json", served, signature().inputs)
    answer = json.loads(caught.value.serialize_as_json())
    assert answer["error_code"] == "INVALID_PARAMETER_VALUE"
    assert answer["message"] == message
    assert SECRET not in caught.value.serialize_as_json()
