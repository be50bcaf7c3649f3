"""What writes events from the edges: call capture and durable publishing (used by the proxy)."""
