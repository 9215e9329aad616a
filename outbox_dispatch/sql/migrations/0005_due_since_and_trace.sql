-- When the current attempt became due (the due_at a claim found), so a worker can report how
-- long a row waited between being due (for a row due at enqueue: its commit) and its start.
ALTER TABLE __SCHEMA__.outbox
    ADD COLUMN due_since timestamptz;
