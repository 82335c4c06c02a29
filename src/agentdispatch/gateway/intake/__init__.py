"""Durable intake: Slack, Telegram and Twilio webhooks recorded before the 200."""

from .janitor import Scrubber
from .router import build_router

__all__ = ["Scrubber", "build_router"]
