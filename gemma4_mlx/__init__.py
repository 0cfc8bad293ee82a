"""gemma4-mlx: Gemma 4 text models on MLX, from GGUF or Hugging Face checkpoints."""

# First, before anything imports mlx.core: put a fast BLAS under MLX's Linux CPU backend.
from . import blas as _blas

_blas.preload()

__version__ = "0.1.0"

__all__ = ["load", "generate", "stream_generate", "make_sampler", "make_logits_processors"]


def __getattr__(name):
    # Lazy, so `import gemma4_mlx` stays cheap and the BLAS preload above runs before mlx.core.
    if name in ("load", "generate", "stream_generate"):
        from . import generate as _generate

        return getattr(_generate, name)
    if name in ("make_sampler", "make_logits_processors"):
        from . import sampling as _sampling

        return getattr(_sampling, name)
    raise AttributeError(f"module 'gemma4_mlx' has no attribute {name!r}")
