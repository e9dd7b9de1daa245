"""graphserve: app (see DESIGN.md for what lives here)."""
