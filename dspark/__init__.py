"""dspark: DSpark speculative decoding for Hugging Face decoder LMs."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from .api import GenerationResult, generate, generate_batch
    from .grammar import GrammarSpec
    from .sampling import SamplingParams

__all__ = ["generate", "generate_batch", "GenerationResult", "GrammarSpec", "SamplingParams", "__version__"]

# the public names load on first use, so that `import dspark.<module>` costs only that module (the
# grammar sandbox, a child process of the server, imports llguidance and not torch)
_HOME = {"generate": "api", "generate_batch": "api", "GenerationResult": "api", "GrammarSpec": "grammar",
         "SamplingParams": "sampling"}


def __getattr__(name: str):
    if name in _HOME:
        from importlib import import_module
        value = getattr(import_module(f".{_HOME[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dspark' has no attribute {name!r}")
