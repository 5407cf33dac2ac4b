"""Job arrays across the layers: dealing tasks to hosts, following them, their results."""
