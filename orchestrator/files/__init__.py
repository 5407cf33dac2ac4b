"""Files between this machine and the hosts: local file lists and digests, code and shard
push, pull and its destination, split-data."""
