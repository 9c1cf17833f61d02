"""The URL policy params every fetching stage shares (`download`'s keys, read by `metadata` and
`dedupe` too): which schemes and which addresses may be fetched (`prep.urlguard`)."""

# not unit-tested: params read by the fetching stages; tests/stages/test_download.py and
# tests/prep/test_captions.py run them with bad and good values.

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from clipms.schema import Section
from pipeline.params import PARAMS_FILE, read_params, validate_section
from prep.urlguard import FetchPolicy, allowed_schemes


class FetchParams(Section):
    """The policy keys of the `download` section (DownloadParams extends it)."""

    allowed_schemes: list[str] = Field(default_factory=lambda: ["http", "https"], min_length=1)
    allow_private_addresses: bool = False
    allowed_networks: list[str] = Field(default_factory=list)
    max_image_bytes: int = Field(32 << 20, ge=1024)

    @field_validator("allowed_schemes")
    @classmethod
    def _schemes(cls, value: list[str]) -> list[str]:
        for scheme in value:
            if not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.\-]*", scheme):
                raise ValueError(f"{scheme!r} is not a URL scheme (e.g. http, https)")
            if scheme.lower() == "file":
                raise ValueError("'file' is not allowed here: it is added automatically for "
                                 "metadata.source synthetic and refused for any other source")
        return [s.lower() for s in value]

    @field_validator("allowed_networks")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        for network in value:
            try:
                ipaddress.ip_network(network)
            except ValueError as err:
                raise ValueError(f"{network!r} is not a network in CIDR form (e.g. "
                                 f"10.1.2.3/32): {err}") from err
        return value

    def policy(self, source: str) -> FetchPolicy:
        return FetchPolicy(allowed_schemes(self.allowed_schemes, source),
                           self.allow_private_addresses, tuple(self.allowed_networks),
                           self.max_image_bytes)


class SourceParams(Section):
    """The one key of the `metadata` section that the policy depends on."""

    source: Literal["synthetic", "mscoco", "local"] = "synthetic"


def read_source(params: dict, path: Path | str) -> str:
    metadata = params.get("metadata") or {}
    return validate_section("metadata", SourceParams,
                            {"source": metadata.get("source", "synthetic")},
                            source=str(path)).source


def fetch_policy(path: Path | str = PARAMS_FILE) -> FetchPolicy:
    """The URL policy from the `download` section's policy keys (the rest of the section is the
    download stage's to validate) and `metadata.source`."""
    params = read_params(path)
    download = params.get("download") or {}
    picked = {k: v for k, v in download.items() if k in FetchParams.model_fields}
    fetch = validate_section("download", FetchParams, picked, source=str(path))
    return fetch.policy(read_source(params, path))
