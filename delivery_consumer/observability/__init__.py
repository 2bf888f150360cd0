"""What the package tells about itself: Prometheus metrics, log set-up, OpenTelemetry traces (tracing/)."""
