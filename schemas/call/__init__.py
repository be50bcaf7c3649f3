"""Model call events (one per call through the proxy). One module per major version."""
