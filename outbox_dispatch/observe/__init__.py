"""What the outbox tells the outside: Prometheus metrics and OpenTelemetry traces."""
