"""Jetson Orin (and any device) memory probes and the long-run soak runner. Depends on `streaming`."""
