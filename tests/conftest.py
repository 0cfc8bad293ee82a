"""Shared pytest setup. Fixture checkpoints live in tests/fixtures.py (imported here)."""
