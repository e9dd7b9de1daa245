"""Ray Serve wiring: `serve run app:deployment` (see app/builder.py)."""

from app.builder import deployment

__all__ = ["deployment"]
