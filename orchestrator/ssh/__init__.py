"""SSH under the remote layer: paramiko channels, host keys, ssh_config, bastions, and
what a failed connection means. Imported only by a command that opens a connection."""
