"""Scheduling and paged KV block management."""
