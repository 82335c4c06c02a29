"""The Kafka transport: turns travel on a topic; the store stays in SQL."""
