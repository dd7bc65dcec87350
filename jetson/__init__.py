"""Jetson Orin memory probes and the soak runner (planned). Depends on `streaming`."""
