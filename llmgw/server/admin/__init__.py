"""The admin listener: /api/v1 handlers, metrics, health."""
