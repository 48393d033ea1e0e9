"""Observability: OpenTelemetry tracing and Prometheus metrics. Imports nothing of the project
but ``specdec.errors``; any layer above ``exact`` may record spans and metrics."""
