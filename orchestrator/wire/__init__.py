"""What travels to the hosts with the agent and is read on both sides: the frames and
messages (protocol), every timeout (timeouts). Stdlib only, Python 3.8."""
