"""Integrations with frameworks that own the application's database connection."""
