"""The demo: a small shop's workload delivered through a real worker and beat."""
