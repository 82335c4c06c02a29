-- Bearer tokens of the gateway: stored hashed, each bound to one tenant.
CREATE TABLE IF NOT EXISTS api_tokens (
    token_id   text PRIMARY KEY,
    token_hash text NOT NULL UNIQUE,
    tenant     text NOT NULL,
    label      text NOT NULL DEFAULT '',
    created_at double precision NOT NULL,
    revoked_at double precision
);
