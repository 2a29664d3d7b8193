"""Logging set-up shared by every service: one line per event, never prompt text."""
from __future__ import annotations

import logging
import os
import sys


def setup_logging(service: str, level: str | None = None) -> logging.Logger:
    level = (level or os.environ.get("MESHLLM_LOG_LEVEL", "INFO")).upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    return logging.getLogger(f"meshllm.{service}")
