"""dspark: DSpark speculative decoding for Hugging Face decoder LMs."""

__version__ = "0.1.0"

from .api import GenerationResult, generate, generate_batch  # noqa: E402
from .sampling import SamplingParams  # noqa: E402
from .structured import GrammarSpec  # noqa: E402

__all__ = ["generate", "generate_batch", "GenerationResult", "GrammarSpec", "SamplingParams", "__version__"]
