"""gemma4-mlx: Gemma 4 text models on MLX, from GGUF or Hugging Face checkpoints."""

__version__ = "0.1.0"
