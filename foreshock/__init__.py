"""Foreshock: fabric telemetry and failure prediction for GPU training clusters."""

__version__ = "0.1.0"
