"""`orch dashboard` and `orch up --dashboard`: a local web page for a job.

One more reader of the run's event stream (watch/events.py): `board.Board` turns events,
GPU samples, curves and array rows into plain data; `feeds.py` feeds it (api.follow's
stream, the status sampler on the same connection, the curves' local copies);
`server.py` serves the page (package data under `static/`) and that data as JSON on
127.0.0.1, behind a token. What a rank printed is text to the page, never markup."""
