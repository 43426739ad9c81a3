"""Metrics exporters (NVML and virtual-GPU collectors) for Prometheus; depends on specs only."""
