"""gemma4-mlx: Gemma 4 text models on MLX, from GGUF or Hugging Face checkpoints."""

# First, before anything imports mlx.core: put a fast BLAS under MLX's Linux CPU backend.
from . import blas as _blas

_blas.preload()

__version__ = "0.1.0"

import warnings  # noqa: E402

# `python -m gemma4_mlx.generate` runs the module that this package also imports for its API.
warnings.filterwarnings("ignore", message=r"'gemma4_mlx\.\w+' found in sys\.modules", category=RuntimeWarning)

from .generate import generate, load, stream_generate  # noqa: E402  (after the BLAS preload)
from .sampling import make_logits_processors, make_sampler  # noqa: E402
from .cpu_matvec import install_sgemm_hook as _install_sgemm_hook  # noqa: E402

# MLX's Linux CPU build: its f32 matmuls of 1..8 rows (the decoder's linears) go through the native
# matvec, every other BLAS call through the preloaded BLAS (verified once; a no-op elsewhere, and
# with GEMMA4_MLX_CPU_MATVEC=off).
_install_sgemm_hook()

__all__ = ["load", "generate", "stream_generate", "make_sampler", "make_logits_processors"]
