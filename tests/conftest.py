"""Shared fixtures. Servers that tests start listen on 127.0.0.1 and are stopped by the fixture."""

from __future__ import annotations

import os

# Same offline defaults as the Makefile, for a bare `pytest` run too.
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("GLOG_v", "3")
