"""Ollama's API: one adapter over the conversation model."""
