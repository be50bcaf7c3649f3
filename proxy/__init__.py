"""The harness-facing proxy in front of vLLM.

OpenAI Chat, OpenAI Responses and Anthropic Messages, with token-exact capture of
every call onto Kafka.
"""
