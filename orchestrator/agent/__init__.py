"""Everything that runs on a host (stdlib only, Python >= 3.8).

The controller zips this package with ``orchestrator/wire/protocol.py`` (``bundle.py``) and
sends it on stdin to ``python -S -c BOOT``; ``boot.py`` imports it from memory and runs
``main.main``. Nothing is written to the host to run it.
"""
