-- Bearer tokens of the gateway: stored hashed, each bound to one tenant.
CREATE TABLE IF NOT EXISTS api_tokens (
    token_id   TEXT PRIMARY KEY,
    token_hash TEXT NOT NULL UNIQUE,
    tenant     TEXT NOT NULL,
    label      TEXT NOT NULL DEFAULT '',
    created_at REAL NOT NULL,
    revoked_at REAL
);
