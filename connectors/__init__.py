"""Connectors to the outside world (see DESIGN.md section 2). Not built yet: this package is a placeholder."""

__all__: list[str] = []
