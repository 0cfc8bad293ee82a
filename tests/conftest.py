"""Shared pytest setup: the tiny Gemma 4 fixture checkpoints of tests/fixtures.py."""

from fixtures import *  # noqa: F401,F403  (session fixtures: dense_fixture, moe_fixture, eseries_fixture, ...)
