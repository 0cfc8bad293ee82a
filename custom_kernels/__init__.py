"""Custom MLX kernels for Gemma 4 (Metal and CUDA from one source, pure-MLX references on CPU)."""
