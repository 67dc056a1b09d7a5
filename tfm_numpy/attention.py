"""Placeholder: filled by the issue that builds this module."""

__all__: list[str] = []
