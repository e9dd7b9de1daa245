"""graphserve: policies (see DESIGN.md for what lives here)."""
