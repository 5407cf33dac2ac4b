"""Stand-in entrypoint for the broken-inventory corpus."""
