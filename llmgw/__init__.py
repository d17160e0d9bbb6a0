"""llmgw: one OpenAI-compatible endpoint in front of your inference engines."""

__version__ = "0.1.0"
