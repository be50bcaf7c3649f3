"""Continuation: a rollout's next call extends the exact token ids of its earlier turn.

:mod:`~proxy.continuation.engine` talks to the engine's token-in/token-out endpoints,
:mod:`~proxy.continuation.history` keeps a rollout's turns, :mod:`~proxy.continuation.planner`
decides each call's prompt.
"""
