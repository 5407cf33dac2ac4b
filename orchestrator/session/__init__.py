"""The verbs on many hosts: open, preflight, sync, setup, launch, stop, status, exec; the
job's saved state."""
