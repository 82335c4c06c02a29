"""Durable intake: Slack, Telegram and Twilio webhooks recorded before the 200."""

from .router import build_router

__all__ = ["build_router"]
