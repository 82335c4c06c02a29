"""Durable intake: Slack, Telegram and Twilio webhooks recorded before the 200.

The HTTP routes live in :mod:`agentdispatch.gateway.intake`; this package holds
what they and the worker-side turn use: the intake store, signatures,
admission, the outbound replies and the retention scrubber."""
