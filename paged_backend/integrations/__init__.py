"""Adapters for code users already have."""
