"""The OpenAI-compatible HTTP server: `hipfire-serve serve` (see docs/server.md)."""
