"""The embedded backend: one SQLite file holds the store and the queue."""
