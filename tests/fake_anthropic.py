"""A local fake of the Anthropic Messages API for tests (no network, no key needed).

``fake_anthropic_server(responses)`` starts an HTTP server on 127.0.0.1 (ephemeral port) in a
daemon thread that answers ``POST /v1/messages`` from a scripted queue, and records every
request (headers and JSON body) for assertions::

    with fake_anthropic_server([kernel_reply(SRC, "first try")]) as srv:
        monkeypatch.setenv("ANTHROPIC_BASE_URL", srv.base_url)
        ...
        assert srv.requests[0].body["system"][-1]["cache_control"] == {"type": "ephemeral"}

    with fake_anthropic_server([...]) as (base_url, requests):   # unpacking works too
        ...

Each scripted item is a ``FakeResponse`` built by one of the helpers below: valid tool_use replies
(``kernel_reply``), malformed ones (``text_reply``, ``two_tool_calls_reply``, ``truncated_reply``,
``kernel_reply`` with invalid Python or a wrong language), API errors (``error_reply``,
``rate_limited``, ``overloaded``, ``server_error``, ``unauthorized``) and slow replies (``slow``).
Successful bodies follow the real API schema (id, type "message", role, model, content,
stop_reason, stop_sequence, usage with cache fields), so a client built with
``_strict_response_validation=True`` accepts them; error bodies follow the API's error shape.

The server also checks requests the way the real API does where tests could go wrong silently
(missing key or version header, missing fields, a tool_use without a matching tool_result in the
next user turn, a forced tool that is not defined) and answers 400/401 like the API would.
When the queue is empty it answers 400 (never retried by clients), so a test cannot hang on it.
The server never logs request headers (the key is only kept in ``requests`` for assertions).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

DEFAULT_MODEL = "claude-test-model"
_ids = itertools.count(1)


@dataclass
class FakeResponse:
    """One scripted answer: HTTP status, JSON body, extra headers, and a delay before answering."""

    status: int = 200
    body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0


@dataclass
class RecordedRequest:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    body: Any  # parsed JSON (or the raw text when it is not JSON)
    response_status: int = 0

    # -- conveniences for assertions ---------------------------------------------------
    @property
    def system_blocks(self) -> list[dict[str, Any]]:
        s = self.body.get("system") if isinstance(self.body, dict) else None
        if isinstance(s, str):
            return [{"type": "text", "text": s}]
        return list(s or [])

    @property
    def system_text(self) -> str:
        return "\n".join(b.get("text", "") for b in self.system_blocks)

    @property
    def user_text(self) -> str:
        """All text of every user turn (text blocks and tool_result contents)."""
        out: list[str] = []
        for m in self.body.get("messages", []) if isinstance(self.body, dict) else []:
            if m.get("role") != "user":
                continue
            out.extend(_texts(m.get("content")))
        return "\n".join(out)

    @property
    def prompt_text(self) -> str:
        return self.system_text + "\n" + self.user_text


def _texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    out: list[str] = []
    for b in content or []:
        if not isinstance(b, dict):
            continue
        if b.get("type") == "text":
            out.append(b.get("text", ""))
        elif b.get("type") == "tool_result":
            out.extend(_texts(b.get("content")))
    return out


# --- response builders ------------------------------------------------------------------


def usage(
    input_tokens: int = 1200,
    output_tokens: int = 300,
    cache_creation_input_tokens: int = 0,
    cache_read_input_tokens: int = 0,
) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": cache_creation_input_tokens,
        "cache_read_input_tokens": cache_read_input_tokens,
        "cache_creation": {
            "ephemeral_5m_input_tokens": cache_creation_input_tokens,
            "ephemeral_1h_input_tokens": 0,
        },
        "service_tier": "standard",
    }


def message(
    content: list[dict[str, Any]],
    *,
    stop_reason: str = "end_turn",
    model: str = DEFAULT_MODEL,
    usage_: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    delay: float = 0.0,
) -> FakeResponse:
    body = {
        "id": f"msg_fake{next(_ids):06d}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": usage_ or usage(),
    }
    return FakeResponse(200, body, dict(headers or {}), delay)


def tool_use_block(input_: dict[str, Any], name: str = "submit_kernel", block_id: str | None = None) -> dict[str, Any]:
    return {"type": "tool_use", "id": block_id or f"toolu_fake{next(_ids):06d}", "name": name, "input": input_}


def kernel_reply(
    source: str,
    conclusion: str = "",
    language: str = "pytorch",
    knobs: dict[str, list[Any]] | None = None,
    *,
    rationale: str = "fake rationale",
    usage_: dict[str, Any] | None = None,
    model: str = DEFAULT_MODEL,
    text: str | None = None,
) -> FakeResponse:
    """A valid ``submit_kernel`` tool_use reply carrying ``source`` (stop_reason tool_use)."""
    inp: dict[str, Any] = {"source": source, "language": language, "conclusion": conclusion, "rationale": rationale}
    if knobs is not None:
        inp["knobs"] = knobs
    content = ([{"type": "text", "text": text}] if text else []) + [tool_use_block(inp)]
    return message(content, stop_reason="tool_use", model=model, usage_=usage_)


def text_reply(text: str = "Here is my kernel: ...", **kw: Any) -> FakeResponse:
    """Malformed: text only, no tool call."""
    return message([{"type": "text", "text": text}], stop_reason="end_turn", **kw)


def two_tool_calls_reply(source_a: str, source_b: str, language: str = "pytorch", **kw: Any) -> FakeResponse:
    """Malformed: two submit_kernel calls in one reply."""
    blocks = [
        tool_use_block({"source": s, "language": language, "conclusion": "", "rationale": "r"})
        for s in (source_a, source_b)
    ]
    return message(blocks, stop_reason="tool_use", **kw)


def truncated_reply(source: str, language: str = "pytorch", **kw: Any) -> FakeResponse:
    """Malformed: hit max_tokens in the middle of the tool call (partial source)."""
    partial = source[: max(1, len(source) // 2)]
    block = tool_use_block({"source": partial, "language": language, "conclusion": "", "rationale": "r"})
    return message([block], stop_reason="max_tokens", **kw)


def error_reply(status: int, err_type: str, msg: str, headers: dict[str, str] | None = None) -> FakeResponse:
    body = {"type": "error", "error": {"type": err_type, "message": msg}, "request_id": f"req_fake{next(_ids):06d}"}
    return FakeResponse(status, body, dict(headers or {}))


def rate_limited(retry_after: float | None = 0.05) -> FakeResponse:
    headers = {} if retry_after is None else {"retry-after": f"{retry_after:g}"}
    return error_reply(429, "rate_limit_error", "Number of request tokens has exceeded your rate limit.", headers)


def overloaded() -> FakeResponse:
    return error_reply(529, "overloaded_error", "Overloaded")


def server_error(status: int = 500) -> FakeResponse:
    return error_reply(status, "api_error", "Internal server error")


def unauthorized() -> FakeResponse:
    return error_reply(401, "authentication_error", "invalid x-api-key")


def slow(response: FakeResponse, delay: float) -> FakeResponse:
    """The same response, sent after ``delay`` seconds (for client timeouts)."""
    return FakeResponse(response.status, response.body, dict(response.headers), delay)


# --- request checks (a subset of what the real API enforces) ------------------------------


def _check_request(headers: dict[str, str], body: Any) -> tuple[int, str, str] | None:
    if not headers.get("x-api-key") and not headers.get("authorization"):
        return 401, "authentication_error", "x-api-key header is required"
    if not headers.get("anthropic-version"):
        return 400, "invalid_request_error", "anthropic-version: header is required"
    if not isinstance(body, dict):
        return 400, "invalid_request_error", "body: expected a JSON object"
    for key in ("model", "max_tokens", "messages"):
        if key not in body:
            return 400, "invalid_request_error", f"{key}: Field required"
    msgs = body["messages"]
    if not isinstance(msgs, list) or not msgs:
        return 400, "invalid_request_error", "messages: at least one message is required"
    if msgs[0].get("role") != "user":
        return 400, "invalid_request_error", "messages: first message must use the user role"
    for i, m in enumerate(msgs):
        if m.get("role") not in ("user", "assistant"):
            return 400, "invalid_request_error", f"messages.{i}.role: must be user or assistant"
        c = m.get("content")
        if c in (None, "", []):
            return 400, "invalid_request_error", f"messages.{i}: content must be non-empty"
        if m["role"] == "assistant" and isinstance(c, list):
            ids = {b.get("id") for b in c if isinstance(b, dict) and b.get("type") == "tool_use"}
            if ids:
                nxt = msgs[i + 1] if i + 1 < len(msgs) else None
                got = set()
                if nxt and nxt.get("role") == "user" and isinstance(nxt.get("content"), list):
                    got = {b.get("tool_use_id") for b in nxt["content"] if b.get("type") == "tool_result"}
                if not ids <= got:
                    return (
                        400,
                        "invalid_request_error",
                        f"messages.{i + 1}: tool_use ids were found without tool_result blocks immediately after",
                    )
    system = body.get("system")
    if isinstance(system, list):
        for j, b in enumerate(system):
            if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
                return 400, "invalid_request_error", f"system.{j}: expected a text block"
            cc = b.get("cache_control")
            if cc is not None and cc.get("type") != "ephemeral":
                return 400, "invalid_request_error", f"system.{j}.cache_control.type: must be ephemeral"
    tools = body.get("tools") or []
    names = {t.get("name") for t in tools if isinstance(t, dict)}
    for t in tools:
        if "input_schema" not in t:
            return 400, "invalid_request_error", "tools: input_schema: Field required"
    tc = body.get("tool_choice")
    if isinstance(tc, dict) and tc.get("type") == "tool" and tc.get("name") not in names:
        return 400, "invalid_request_error", f"tool_choice: tool {tc.get('name')!r} not found in tools"
    return None


# --- the server ---------------------------------------------------------------------------


class FakeAnthropicServer:
    """Scripted Messages API server. Use through ``fake_anthropic_server``."""

    def __init__(self, responses: Iterable[FakeResponse] = (), default: FakeResponse | None = None):
        self.queue: deque[FakeResponse] = deque(responses)
        self.default = default
        self.requests: list[RecordedRequest] = []
        self.request_times: list[float] = []  # time.monotonic() at arrival of each request
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # unpacking: ``with fake_anthropic_server(r) as (base_url, requests)``
    def __iter__(self) -> Iterator[Any]:
        return iter((self.base_url, self.requests))

    @property
    def base_url(self) -> str:
        assert self._httpd is not None, "server not started"
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def push(self, *responses: FakeResponse) -> None:
        with self._lock:
            self.queue.extend(responses)

    @property
    def remaining(self) -> int:
        with self._lock:
            return len(self.queue)

    def _next(self) -> FakeResponse | None:
        with self._lock:
            if self.queue:
                return self.queue.popleft()
            return self.default

    def start(self) -> FakeAnthropicServer:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # never log (headers carry the key)
                pass

            def _send(self, resp: FakeResponse) -> None:
                data = json.dumps(resp.body).encode()
                try:
                    self.send_response(resp.status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(data)))
                    self.send_header("request-id", f"req_fake{next(_ids):06d}")
                    for k, v in resp.headers.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(data)
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError, OSError):
                    pass  # the client gave up (timeout): nothing to do

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body: Any = json.loads(raw or b"null")
                except json.JSONDecodeError:
                    body = raw.decode(errors="replace")
                headers = {k.lower(): v for k, v in self.headers.items()}
                rec = RecordedRequest("POST", self.path.split("?")[0], headers, body)
                with server._lock:
                    server.requests.append(rec)
                    server.request_times.append(time.monotonic())
                if rec.path != "/v1/messages":
                    rec.response_status = 404
                    self._send(error_reply(404, "not_found_error", f"no route {rec.path}"))
                    return
                problem = _check_request(headers, body)
                if problem:
                    rec.response_status = problem[0]
                    self._send(error_reply(*problem))
                    return
                resp = server._next()
                if resp is None:
                    rec.response_status = 400
                    self._send(error_reply(400, "invalid_request_error", "fake server: no scripted response left"))
                    return
                if resp.delay and server._stop.wait(resp.delay):
                    return  # shutting down
                body_out = dict(resp.body)
                if resp.status == 200 and isinstance(body.get("model"), str) and body_out.get("model") == DEFAULT_MODEL:
                    body_out["model"] = body["model"]  # echo the requested model like the API does
                rec.response_status = resp.status
                self._send(FakeResponse(resp.status, body_out, resp.headers))

            def do_GET(self) -> None:  # noqa: N802
                self._send(error_reply(404, "not_found_error", "GET is not supported by the fake"))

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)


@contextlib.contextmanager
def fake_anthropic_server(
    responses: Iterable[FakeResponse] = (), default: FakeResponse | None = None
) -> Iterator[FakeAnthropicServer]:
    """Run a fake Messages API server; yields it (``.base_url``, ``.requests``, ``.push()``)."""
    srv = FakeAnthropicServer(responses, default).start()
    try:
        yield srv
    finally:
        srv.stop()


try:  # a pytest fixture for tests that import it: ``from fake_anthropic import anthropic_fake``
    import pytest

    @pytest.fixture
    def anthropic_fake(monkeypatch: Any) -> Iterator[FakeAnthropicServer]:
        """An empty fake server with ANTHROPIC_BASE_URL and a dummy ANTHROPIC_API_KEY set; ``push()`` replies."""
        with fake_anthropic_server() as srv:
            monkeypatch.setenv("ANTHROPIC_BASE_URL", srv.base_url)
            monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-test-dummy-key-0000")
            yield srv

except ImportError:  # pragma: no cover
    pass
