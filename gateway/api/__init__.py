"""The OpenAI-compatible HTTP API: routes, wire shapes, serving, SSE, errors and request guards."""
