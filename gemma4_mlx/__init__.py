"""gemma4-mlx: Gemma 4 text models on MLX, from GGUF or Hugging Face checkpoints."""

# First, before anything imports mlx.core: put a fast BLAS under MLX's Linux CPU backend.
from . import blas as _blas

_blas.preload()

__version__ = "0.1.0"
