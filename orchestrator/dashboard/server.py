"""The page's server: the stdlib's ThreadingHTTPServer on 127.0.0.1, one thread per
request. One local reader polls a few small JSON documents a second; threads match the
library's blocking event stream and add no dependency to the base install (the reasons
in docs/explanation/dashboard.md).

Every request needs the token: in the URL (`?token=`, which also sets a same-site,
HttpOnly cookie for the page's own requests), a header, or that cookie; else 403. A
request whose Host is not this server's loopback address is refused too (DNS
rebinding). Every answer forbids inline scripts (Content-Security-Policy), and the page
inserts what ranks printed as text."""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import re
import secrets
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.cookies import SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any, TypedDict
from urllib.parse import parse_qs, urlsplit

from orchestrator.dashboard.board import Board
from orchestrator.errors import HostError, OrchError

STATIC = ("index.html", "app.js", "app.css", "uPlot.iife.min.js", "uPlot.min.css")
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8"}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
TEXT = "text/plain; charset=utf-8"
MAX_BODY = 4096        # a stop request's body, which carries nothing we read

Stop = Callable[[], str]    # stops the job; the words to show (raises OrchError)
# reads rank R's whole log on its host into `out`; what ended it early, or "" (raises OrchError)
LogReader = Callable[[int, Callable[[bytes], None]], str]
log = logging.getLogger("orchestrator")


def static(name: str) -> bytes:
    return (resources.files("orchestrator.dashboard") / "static" / name).read_bytes()


class Dashboard:
    """The server of one board, on 127.0.0.1:`port` (0: any free port)."""

    def __init__(self, board: Board, stop: Stop | None, port: int = 0,
                 read_log: LogReader | None = None) -> None:
        self.board, self.stop, self.read_log = board, stop, read_log
        self.token = secrets.token_urlsafe(32)
        self.httpd = Server(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.httpd.dashboard = self  # type: ignore[attr-defined]
        self.port = int(self.httpd.server_address[1])
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/?token={self.token}"

    @property
    def cookie(self) -> str:
        return f"orch-dashboard-{self.port}"    # cookies do not tell ports apart

    def start(self) -> Dashboard:
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True,
                                       name="dashboard")
        self.thread.start()
        return self

    def close(self) -> None:
        if self.thread is not None:
            self.httpd.shutdown()
        self.httpd.server_close()

    def allowed(self, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given.encode(), self.token.encode())

    def saved_page(self) -> bytes:
        """The page with its scripts, styles and data inline: one file that opens
        anywhere, its scripts allowed by their hashes alone."""
        return saved_page(self.board)


class Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A browser gone mid-answer is no news: the terminal is the run's (the stdlib
        would print a traceback there)."""
        log.debug("dashboard: a request failed", exc_info=True)


class Handler(BaseHTTPRequestHandler):
    server_version = "orch-dashboard"
    sys_version = ""

    @property
    def dash(self) -> Dashboard:
        return self.server.dashboard  # type: ignore[attr-defined,no-any-return]

    def log_message(self, format: str, *args: Any) -> None:   # quiet: the terminal is the run's
        pass

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        if not self.checked(query):
            return
        route = GETS.get(url.path)
        if route is not None:
            route(self, query)
        elif url.path.startswith("/static/") and url.path[8:] in STATIC:
            name = url.path[8:]
            self.send(HTTPStatus.OK, static(name), TYPES[name[name.rindex("."):]])
        else:
            self.send_json({"error": "not found"}, HTTPStatus.NOT_FOUND)

    def do_POST(self) -> None:
        url = urlsplit(self.path)
        # a form from another site carries the cookie at most, never the header
        if not self.checked({}, header_only=True):
            return
        length = min(number({"n": [self.headers.get("Content-Length") or "0"]}, "n"), MAX_BODY)
        self.rfile.read(length)
        if url.path != "/api/stop":
            self.send_json({"error": "not found"}, HTTPStatus.NOT_FOUND)
        elif self.dash.stop is None:
            self.send_json({"ok": False, "message": "this page cannot stop the job"})
        else:
            reply = run_stop(self.dash.stop)
            # kept as a note: the page redraws its notes from each poll, so a reply shown
            # only by the button's own fetch would be wiped within a second
            self.dash.board.note(reply["message"])
            self.send_json(reply)

    def checked(self, query: dict[str, list[str]], header_only: bool = False) -> bool:
        """The right Host and the token, else 403 (and False)."""
        host = self.headers.get("Host", "")
        if host not in (f"127.0.0.1:{self.dash.port}", f"localhost:{self.dash.port}"):
            self.send(HTTPStatus.FORBIDDEN, b"forbidden: not this server's address\n", "text/plain; charset=utf-8")
            return False
        given = [self.headers.get("X-Orch-Token")]
        if not header_only:
            given += [query.get("token", [None])[0], self.cookie_token()]
        if any(self.dash.allowed(g) for g in given):
            return True
        self.send(HTTPStatus.FORBIDDEN, b"forbidden: open the URL that orch dashboard printed "
                  b"(it carries the token)\n", "text/plain; charset=utf-8")
        return False

    def cookie_token(self) -> str | None:
        jar: SimpleCookie = SimpleCookie()
        try:
            jar.load(self.headers.get("Cookie", ""))
        except Exception:    # a malformed cookie header is no token
            return None
        morsel = jar.get(self.dash.cookie)
        return morsel.value if morsel is not None else None

    def send(self, status: HTTPStatus, body: bytes, ctype: str,
             extra: dict[str, str] | None = None) -> None:
        self.head(status, ctype, {"Content-Length": str(len(body)), **(extra or {})})
        if self.command != "HEAD":
            self.wfile.write(body)

    def head(self, status: HTTPStatus, ctype: str, extra: dict[str, str]) -> None:
        """The status and headers; without a Content-Length the body ends with the
        connection (HTTP/1.0: a streamed download)."""
        self.send_response(status)
        headers = {"Content-Type": ctype, "Content-Security-Policy": CSP,
                   "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
                   "Cache-Control": "no-store", "X-Frame-Options": "DENY", **extra}
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()

    def send_json(self, doc: Any, status: HTTPStatus = HTTPStatus.OK) -> None:
        self.send(status, json.dumps(doc).encode(), "application/json")

    def page(self, query: dict[str, list[str]]) -> None:
        cookie = (f"{self.dash.cookie}={self.dash.token}; Path=/; HttpOnly; SameSite=Strict")
        self.send(HTTPStatus.OK, static("index.html"), TYPES[".html"], {"Set-Cookie": cookie})

    def state(self, query: dict[str, list[str]]) -> None:
        """`?have=events:3,curves:1`: the parts the page holds at those versions are left out."""
        have = {}
        for item in query.get("have", [""])[0].split(",")[:10]:
            part, _, version = item.partition(":")
            if version.isdigit():
                have[part] = int(version)
        self.send_json(self.dash.board.snapshot(have))

    def log(self, query: dict[str, list[str]]) -> None:
        rank, after = number(query, "rank"), number(query, "after")
        self.send_json(self.dash.board.log(rank, after))

    def log_text(self, query: dict[str, list[str]]) -> None:
        """Rank R's whole log, streamed from its host as `orch logs --rank R` reads it
        (capped: page.MAX_DOWNLOAD_*); without a reader, the lines the board holds."""
        rank = number(query, "rank")
        disposition = {"Content-Disposition": attachment(f"{self.dash.board.job}-rank-{rank}.log")}
        if self.dash.read_log is None:
            self.send(HTTPStatus.OK, self.dash.board.log_text(rank).encode(), TEXT, disposition)
            return
        stream = Streamed(self, disposition)
        try:
            why = self.dash.read_log(rank, stream.write)
        except OrchError as e:
            if not stream.started:
                text = e.message + (f" (fix: {e.hint})" if e.hint else "") + "\n"
                self.send(HTTPStatus.BAD_GATEWAY if isinstance(e, HostError) else HTTPStatus.BAD_REQUEST,
                          text.encode(), TEXT)
                return
            why = e.message
        stream.end(why)

    def save(self, query: dict[str, list[str]]) -> None:
        self.send(HTTPStatus.OK, self.dash.saved_page(), TYPES[".html"],
                  {"Content-Disposition": attachment(f"{self.dash.board.job}-dashboard.html")})


class Streamed:
    """An answer sent as it comes: the headers with its first bytes."""

    def __init__(self, handler: Handler, extra: dict[str, str]) -> None:
        self.handler, self.extra, self.started = handler, extra, False

    def write(self, data: bytes) -> None:
        if not self.started:
            self.started = True
            self.handler.head(HTTPStatus.OK, TEXT, self.extra)
        self.handler.wfile.write(data)

    def end(self, why: str) -> None:
        """The end; what cut it short (a host lost, the cap) as the last line."""
        self.write(b"")
        if why:
            self.handler.wfile.write(f"\n[orch dashboard: {why}]\n".encode())


GETS: dict[str, Callable[[Handler, dict[str, list[str]]], None]] = {
    "/": Handler.page, "/index.html": Handler.page, "/api/state": Handler.state,
    "/api/log": Handler.log, "/api/log.txt": Handler.log_text, "/save": Handler.save,
}


def number(query: dict[str, list[str]], key: str) -> int:
    try:
        return max(0, int(query.get(key, ["0"])[0]))
    except ValueError:
        return 0


def safe_name(name: str) -> str:
    """A file name for any job, host or rank: ASCII letters, digits, `.`, `_` and `-`
    only (no quote, separator or control character), never hidden, at most 120."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".-")[:120] or "orch"


def attachment(name: str) -> str:
    return f'attachment; filename="{safe_name(name)}"'


class StopReply(TypedDict):
    ok: bool
    message: str   # what `orch stop` says, or its error with the fix


def run_stop(stop: Stop) -> StopReply:
    from orchestrator.errors import OrchError
    try:
        return {"ok": True, "message": stop()}
    except OrchError as e:
        return {"ok": False, "message": e.message + (f" (fix: {e.hint})" if e.hint else "")}


# ---------------------------------------------------------------- one file, saved

def inline_json(doc: Any) -> str:
    """JSON that cannot end the <script> element it sits in, whatever a rank printed."""
    text = json.dumps(doc)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def digest(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def saved_page(board: Board) -> bytes:
    """index.html with the styles and scripts inline, the data beside them (the page
    reads it instead of asking), and a CSP that allows those exact scripts only."""
    page = static("index.html").decode()
    data = inline_json({"state": board.snapshot(), "logs": board.all_logs()})
    scripts, styles = [], []
    for name in ("uPlot.iife.min.js", "app.js"):
        code = static(name).decode()
        assert "</script" not in code.lower()
        scripts.append(code)
        page = page.replace(f'<script src="static/{name}"></script>', f"<script>{code}</script>")
    for name in ("uPlot.min.css", "app.css"):
        css = static(name).decode()
        styles.append(css)
        page = page.replace(f'<link rel="stylesheet" href="static/{name}">', f"<style>{css}</style>")
    csp = (f"default-src 'none'; script-src {' '.join(map(digest, scripts))}; "
           f"style-src {' '.join(map(digest, styles))}; img-src data:; base-uri 'none'")
    head = (f'<meta http-equiv="Content-Security-Policy" content="{csp}">\n'
            f'<script type="application/json" id="orch-data">{data}</script>\n')
    return page.replace("<!--saved-->", head, 1).encode()
