"""Command-line and lab tools around the core (never imported by it)."""
