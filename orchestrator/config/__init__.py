"""cluster.yaml read and checked: every section, every error with its file and line."""
