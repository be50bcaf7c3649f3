"""Fixtures of the proxy tests live in proxy_helpers (shared with the harness tests)."""

from proxy_helpers import proxy, proxy_settings_factory  # noqa: F401 - pytest fixtures
