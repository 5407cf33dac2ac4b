"""How orch writes to the terminal: the console, progress, safe text, wording of counts and hints."""
