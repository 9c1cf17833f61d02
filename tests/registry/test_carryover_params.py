"""What a night may carry over, without a server: the params that ask for it, the model URIs
they take, and the lineage tags they leave (tests/registry/test_carryover.py runs them against
one)."""

from __future__ import annotations

import pytest

from pipeline.params import ParamsError, validate_section
from registry.versions import VersionError, is_model_uri, parse_model_uri
from stages.tokenizer import TokenizerParams
from stages.train import TrainParams
from tracking.lineage import carried_over


def test_tokenizer_pin_takes_a_registered_model_uri_and_nothing_else() -> None:
    for uri in ("models:/clip@champion", "models:/clip/3", "models:/team.clip-v2@nightly_ok"):
        assert validate_section("tokenizer", TokenizerParams, {"pin": uri}).pin == uri
    assert validate_section("tokenizer", TokenizerParams, {}).pin is None  # built by default
    for bad in ("/etc/passwd", "models:/clip", "models:/../x@champion", "runs:/abc/tokenizer",
                "models:/clip@champion/../../x"):
        with pytest.raises(ParamsError, match=r"tokenizer\.pin = "):
            validate_section("tokenizer", TokenizerParams, {"pin": bad})


def test_a_warm_start_has_its_own_budget_and_cold_stays_the_default() -> None:
    params = validate_section("train", TrainParams, {})
    assert params.init_from is None  # cold
    assert (params.warm_start.max_steps, params.warm_start.lr, params.warm_start.warmup_steps) \
        == (300, None, 20)
    warm = validate_section("train", TrainParams, {
        "init_from": "models:/clip@champion", "warm_start": {"max_steps": 50, "lr": 1e-4}})
    assert warm.warm_start.max_steps == 50 and warm.warm_start.lr == 1e-4
    with pytest.raises(ParamsError, match=r"train\.warm_start\.max_steps = 0"):
        validate_section("train", TrainParams, {"warm_start": {"max_steps": 0}})
    with pytest.raises(ParamsError, match=r"train\.warm_start\.steps: unknown key"):
        validate_section("train", TrainParams, {"warm_start": {"steps": 5}})


def test_model_uris_name_an_alias_or_a_version() -> None:
    assert parse_model_uri("models:/clip@champion") == ("clip", "champion", None)
    assert parse_model_uri("models:/clip/12") == ("clip", None, "12")
    with pytest.raises(VersionError, match="expected models:/NAME@ALIAS or models:/NAME/VERSION"):
        parse_model_uri("models:/clip")
    assert is_model_uri("models:/clip@champion") and not is_model_uri("models/clip.ckpt")
    assert not is_model_uri(None) and not is_model_uri("")


def test_the_lineage_names_the_version_a_night_started_from() -> None:
    tags = carried_over("init", "models:/clip@champion", "models:/clip/3", "run-1", "f" * 64)
    assert tags == {"lineage.init_from": "models:/clip/3",
                    "lineage.init_from_uri": "models:/clip@champion",
                    "lineage.init_from_run": "run-1", "lineage.init_sha256": "f" * 64}
    first = carried_over("tokenizer", "models:/clip@champion", None, None, None)
    assert first == {"lineage.tokenizer_from": "none: models:/clip@champion names no registered "
                                               "model yet (the first night)"}
