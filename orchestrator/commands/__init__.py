"""One module per sub-command: add_parser(subparsers) and run(args) -> int. A new command
is also listed in cli.COMMANDS (its name, module and one-line help)."""
