"""Build hook for the optional native CPU matvec (gemma4_mlx/cpu_matvec.c); metadata is in pyproject.toml.

The extension is optional: without a C compiler (or Python headers) the install still succeeds and
gemma4_mlx falls back to MLX's own matmuls (`gemma4_mlx.cpu_matvec.available()` is False)."""

import sys

from setuptools import Extension, setup

if sys.platform == "win32":
    compile_args = ["/O2"]
    link_args = []
else:
    compile_args = ["-O3", "-std=c99", "-fno-strict-aliasing"]
    link_args = [] if sys.platform == "darwin" else ["-pthread"]
    if sys.platform != "darwin":
        compile_args.append("-pthread")

setup(
    ext_modules=[
        Extension(
            "gemma4_mlx._cpu_matvec",
            sources=["gemma4_mlx/cpu_matvec.c"],
            extra_compile_args=compile_args,
            extra_link_args=link_args,
            optional=True,
        )
    ]
)
