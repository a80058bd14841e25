"""Anthropic's Messages API: one adapter over the conversation model."""
