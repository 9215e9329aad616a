"""A minimal Django project for tests/adoption/test_django.py: one app (``shop``) with one
model, on the test Postgres, its tables in the session's schema."""
