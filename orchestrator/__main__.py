from orchestrator.cli import cli

raise SystemExit(cli())
