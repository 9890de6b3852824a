"""tokenmill.telemetry: request spans, the DuckDB trace store, step records, device sampling,
Prometheus metrics and trace dumps. The engine knows nothing of this package's storage; it
emits timestamps and step records, and this package turns them into spans and rows."""
