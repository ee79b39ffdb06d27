"""Saga coordinator (see DESIGN.md section 5). Not built yet: this package is a placeholder."""

__all__: list[str] = []
