"""Per-actor cap semaphores in Redis: acquire, renew, release and their rebuild."""
