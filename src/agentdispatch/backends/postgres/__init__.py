"""The PostgreSQL backend: the store and the queue share one database."""
