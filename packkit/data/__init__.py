"""Bundled sample data (lengths only, no text)."""
