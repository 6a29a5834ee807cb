"""Lightning (ckptstore.integrations.lightning) and telemetry's Prometheus export."""
