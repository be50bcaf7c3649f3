"""The real proxy fixtures, for the trace that starts at a model call."""

from proxy_helpers import proxy, proxy_settings_factory  # noqa: F401 - pytest fixtures
