"""Operator surfaces: the outbox-dispatch command, the web page, app loading."""
