"""The installed version, read from the distribution's metadata (pyproject.toml is the one
place it is written)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("fluxora-webhooks")
except PackageNotFoundError:  # pragma: no cover - running from a source tree, not installed
    __version__ = "0.0.0+unknown"
