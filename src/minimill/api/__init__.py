"""The HTTP surface: routers per resource, wire schemas, auth, OpenAI-style errors."""
