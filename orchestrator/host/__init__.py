"""The host side's own modules (stdlib only, Python 3.8): sent to every host with the agent."""
