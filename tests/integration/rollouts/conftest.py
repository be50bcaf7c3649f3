"""The rollout tests reuse the proxy tests' real proxy fixture (real vLLM, real broker)."""

from proxy_helpers import proxy, proxy_settings_factory  # noqa: F401 - pytest fixtures
