"""Task events (what to run). One module per major version."""
