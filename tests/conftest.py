"""Shared pytest setup: the tiny Gemma 4 fixture checkpoints of tests/fixtures.py."""

import gemma4_mlx  # noqa: F401  first: puts a fast BLAS under MLX before anything imports mlx.core

from fixtures import *  # noqa: F401,F403  (session fixtures: dense_fixture, moe_fixture, eseries_fixture, ...)
