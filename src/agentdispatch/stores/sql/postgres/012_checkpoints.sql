-- A turn's saved progress (guard.checkpoint): JSON text, written only by the
-- fenced checkpoint statement, read with the item by the next attempt.
ALTER TABLE work_items ADD COLUMN IF NOT EXISTS checkpoint text;
