"""What a rollout's own processes rely on: the environment they are given, and the reward's bound.

The launcher and the backends write this environment; ``openforge reward``, run by the verifier
in every rollout where its start-up time counts, reads it. So it sits below producers and
consumers and imports nothing.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "ENV_AGENT_KEYS",
    "ENV_ANTHROPIC_BASE_URL",
    "ENV_INSTRUCTION",
    "ENV_OPENAI_BASE_URL",
    "ENV_PROXY_URL",
    "ENV_REWARD_URL",
    "ENV_ROLLOUT_ID",
    "ENV_TASK_ID",
    "ENV_VERIFIER_TOKEN",
    "REWARD_LIMIT",
]

# The environment a rollout sees. Harnesses read the vendor names; OpenForge's own tools read
# the OPENFORGE_ names.
ENV_OPENAI_BASE_URL = "OPENAI_BASE_URL"
"""``<proxy>/rollouts/<rollout_id>/v1``: the OpenAI SDK, Codex and OpenClaw append paths to it."""
ENV_ANTHROPIC_BASE_URL = "ANTHROPIC_BASE_URL"
"""``<proxy>/rollouts/<rollout_id>``: the Anthropic SDK and Claude Code append ``/v1/messages``."""
ENV_AGENT_KEYS = ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "OPENFORGE_API_KEY")
"""Every variable that carries the agent token, since each harness reads its own."""
ENV_PROXY_URL = "OPENFORGE_PROXY_URL"
"""The proxy's root URL, without the rollout prefix."""
ENV_ROLLOUT_ID = "OPENFORGE_ROLLOUT_ID"
"""The rollout's id."""
ENV_TASK_ID = "OPENFORGE_TASK_ID"
"""The task's id."""
ENV_REWARD_URL = "OPENFORGE_REWARD_URL"
"""``<proxy>/rollouts/<rollout_id>/reward``; only the verifier sees it."""
ENV_INSTRUCTION = "OPENFORGE_INSTRUCTION"
"""The task's instruction, for harnesses that read their prompt from the environment."""
ENV_VERIFIER_TOKEN = "OPENFORGE_VERIFIER_TOKEN"  # noqa: S105 (a variable name, not a secret)
"""The verifier credential; only the verifier sees it, never the harness."""


REWARD_LIMIT: Final = 1e9
"""The largest reward magnitude accepted. A finite reward far past it (a raw score, ``sys.float_info.max``)
is infinite in the learner's float32 arithmetic and turns its whole group's advantages into NaN."""
