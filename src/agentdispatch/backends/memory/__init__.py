"""The in-memory backend behind ``agentdispatch.testing``."""
