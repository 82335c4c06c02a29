-- Which process a worker is, so a peer on the same host can tell that it died
-- and end its leases at once instead of after their TTL.
ALTER TABLE dispatch_workers ADD COLUMN process TEXT NOT NULL DEFAULT '';
