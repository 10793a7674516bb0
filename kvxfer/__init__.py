"""kvxfer: KV-cache transfer between the prefill and decode instances of an LLM server."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvxfer")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
