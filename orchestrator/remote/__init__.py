"""One agent per host, whatever carries it: the channel seam, the link and its frames,
the agent's bundle, and the fan-out of one call over many hosts."""
