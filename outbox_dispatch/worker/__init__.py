"""Running a delivery message in a pool process: start, handler, heartbeat, settle."""
