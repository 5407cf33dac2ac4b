"""Following a running job: every host's output, fail-fast, the root cause, clocks."""
