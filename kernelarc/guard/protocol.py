"""The judge <-> worker wire protocol: length-prefixed frames, typed messages, no pickle from the worker.

The worker runs untrusted code, so everything it sends is data the judge parses defensively:

* A frame is a 4-byte big-endian length and that many bytes. The judge reads frames with a
  deadline and a size cap (``MAX_FRAME``): a worker that sends garbage, a huge length, half a
  frame and then nothing, or closes early, gets a ``ProtocolError`` / ``TimeoutError`` /
  ``EOFError`` and a verdict, never a hung or crashed judge.
* Worker -> judge frames are JSON, validated against the pydantic models below (``extra`` fields
  forbidden, strict types, bounded lengths). The judge never unpickles anything a worker sends.
* Output tensors do not travel in messages: the judge creates a raw byte buffer (a /dev/shm file
  on the CPU, a device tensor shared by CUDA IPC on a GPU), the worker copies each output into it
  at offsets the judge computed, and the judge reads the bytes back with the dtype and shape IT
  expects from the task. An ``OutputMeta`` only reports what the worker's tensor looked like
  (shape, strides, dtype) so that layout violations can be named.
* Judge -> worker frames are pickled dicts ``{"cmd": Cmd..., ...}``: the worker is the untrusted
  side, so unpickling the judge's data there costs nothing (it carries the CUDA IPC handle).
"""

from __future__ import annotations

import contextlib
import pickle
import select
import socket
import struct
import time
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

MAX_FRAME = 1 << 20  # judge-side cap on a worker message (timing samples, error text: far below this)
MAX_TEXT = 20_000
_HEADER = struct.Struct(">I")


class ProtocolError(Exception):
    """The peer sent something that is not a valid message."""


class Kind(StrEnum):
    """Worker -> judge message kinds."""

    ready = "ready"
    imported = "imported"
    ok = "ok"
    outputs = "outputs"
    timing = "timing"
    fail = "fail"
    done = "done"


class Cmd(StrEnum):
    """Judge -> worker commands."""

    job = "job"  # load the task and the candidate; reply imported | fail
    warmup = "warmup"  # one untimed call on inputs from a seed (JIT compilation); reply ok
    check = "check"  # a checked call on inputs from a seed (kept as a timing set if asked); reply outputs
    prepare = "prepare"  # build a timing set from a seed without calling the candidate; reply ok
    reuse = "reuse"  # rewrite timing set 0 in place with set 1's content and call; reply outputs
    stage = "stage"  # generate fresh inputs from a seed for the next burst's checked call; reply ok
    time = "time"  # a burst of timed calls, the last one optionally checked on fresh inputs; reply timing
    end = "end"  # reply done, then wait to be killed


class Tag(StrEnum):
    """What a set of outputs was produced by (chooses the verdict when they are wrong)."""

    check = "check"
    reuse = "reuse"
    timed = "timed"


class FailStatus(StrEnum):
    """Statuses a worker may report: only failures (a worker can never claim success)."""

    incorrect = "incorrect"
    compile_error = "compile_error"
    runtime_error = "runtime_error"
    rejected_hack = "rejected_hack"


class TimerMethod(StrEnum):
    cupti = "cupti"
    events = "events"
    host = "host"


_STRICT = ConfigDict(extra="forbid", strict=True, frozen=True)
Text = Annotated[str, Field(max_length=MAX_TEXT)]
Dim = Annotated[int, Field(ge=0, le=1 << 40)]
Stride = Annotated[int, Field(ge=-(1 << 40), le=1 << 40)]
Ms = Annotated[float, Field(ge=0.0, le=1e7, allow_inf_nan=False)]


class OutputMeta(BaseModel):
    model_config = _STRICT
    name: Annotated[str, Field(max_length=200)]
    shape: Annotated[list[Dim], Field(max_length=16)] | None = None
    strides: Annotated[list[Stride], Field(max_length=16)] | None = None
    dtype: Annotated[str, Field(max_length=40)] | None = None
    scalar: bool | int | float | None = None


class Ready(BaseModel):
    model_config = _STRICT
    kind: Literal[Kind.ready]
    pid: int


class Imported(BaseModel):
    model_config = _STRICT
    kind: Literal[Kind.imported]
    notes: Annotated[list[Text], Field(max_length=64)] = []


class Ok(BaseModel):
    model_config = _STRICT
    kind: Literal[Kind.ok]
    waited_s: Ms = 0.0  # a warm-up's: seconds its benchmarking waited for other processes' timings (benchlock)


class Outputs(BaseModel):
    model_config = _STRICT
    kind: Literal[Kind.outputs]
    tag: Tag
    wl: Dim
    outputs: Annotated[list[OutputMeta], Field(max_length=64)]


class Timing(BaseModel):
    model_config = _STRICT
    kind: Literal[Kind.timing]
    wl: Dim
    method: TimerMethod
    samples_ms: Annotated[list[Ms], Field(min_length=1, max_length=100_000)]
    events_ms: Annotated[list[Ms], Field(max_length=100_000)] | None = None  # CUDA events beside CUPTI
    excess_ms: Ms | None = None  # device-synchronised wall time minus event time of one extra call
    check: Outputs | None = None  # outputs of the burst's last (checked) call


class Fail(BaseModel):
    model_config = _STRICT
    kind: Literal[Kind.fail]
    status: FailStatus
    error: Text
    phases: dict[Annotated[str, Field(max_length=40)], Ms] = {}
    warnings: Annotated[list[Text], Field(max_length=64)] = []


class Done(BaseModel):
    model_config = _STRICT
    kind: Literal[Kind.done]
    phases: dict[Annotated[str, Field(max_length=40)], Ms] = {}
    warnings: Annotated[list[Text], Field(max_length=64)] = []


Message = Annotated[Ready | Imported | Ok | Outputs | Timing | Fail | Done, Field(discriminator="kind")]
_MESSAGE = TypeAdapter(Message)


def parse_message(data: bytes) -> Ready | Imported | Ok | Outputs | Timing | Fail | Done:
    """A worker message from raw frame bytes; ``ProtocolError`` for anything else."""
    try:
        return _MESSAGE.validate_json(data)
    except (ValidationError, ValueError, RecursionError) as e:
        raise ProtocolError(f"invalid message: {str(e)[:500]}") from None


def encode_message(msg: BaseModel) -> bytes:
    return msg.model_dump_json().encode()


class Channel:
    """Frames over a connected stream socket, with deadlines on the receiving side."""

    def __init__(self, sock: socket.socket, max_frame: int = MAX_FRAME):
        self.sock = sock
        self.max_frame = max_frame
        self._buf = bytearray()
        sock.setblocking(False)

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def send_frame(self, payload: bytes, timeout: float = 30.0) -> None:
        """Send one frame; a peer that stops reading cannot block the sender past ``timeout``."""
        data = memoryview(_HEADER.pack(len(payload)) + payload)
        deadline = time.monotonic() + timeout
        while data:
            try:
                n = self.sock.send(data)
                data = data[n:]
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("peer does not read") from None
                select.select([], [self.sock], [], min(left, 1.0))

    def _fill(self, need: int, deadline: float) -> None:
        while len(self._buf) < need:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no complete frame before the deadline")
            r, _, _ = select.select([self.sock], [], [], min(left, 1.0))
            if not r:
                continue
            try:
                chunk = self.sock.recv(min(max(need - len(self._buf), 1 << 16), 1 << 20))
            except BlockingIOError:
                continue
            except ConnectionResetError:
                raise EOFError("connection reset") from None
            if not chunk:
                raise EOFError("peer closed the connection")
            self._buf += chunk

    def recv_frame(self, timeout: float) -> bytes:
        deadline = time.monotonic() + max(timeout, 0.0)
        self._fill(_HEADER.size, deadline)
        (n,) = _HEADER.unpack(bytes(self._buf[: _HEADER.size]))
        if n > self.max_frame:
            raise ProtocolError(f"frame of {n} bytes exceeds the {self.max_frame}-byte limit")
        self._fill(_HEADER.size + n, deadline)
        payload = bytes(self._buf[_HEADER.size : _HEADER.size + n])
        del self._buf[: _HEADER.size + n]
        return payload

    def readable(self, timeout: float) -> bool:
        if self._buf:
            return True
        r, _, _ = select.select([self.sock], [], [], max(timeout, 0.0))
        return bool(r)

    # -- typed helpers -------------------------------------------------------------------
    def send_command(self, cmd: Cmd, **fields: Any) -> None:
        """Judge -> worker (pickle is fine in this direction: the worker is the untrusted side)."""
        self.send_frame(pickle.dumps({"cmd": cmd.value, **fields}, protocol=pickle.HIGHEST_PROTOCOL))

    def recv_command(self, timeout: float = 1e9) -> dict[str, Any]:
        """Worker side: the judge's next command."""
        d = pickle.loads(self.recv_frame(timeout))
        d["cmd"] = Cmd(d["cmd"])
        return d

    def send_message(self, msg: BaseModel) -> None:
        self.send_frame(encode_message(msg))

    def recv_message(self, timeout: float) -> Ready | Imported | Ok | Outputs | Timing | Fail | Done:
        """Judge side: the worker's next message, parsed and validated."""
        return parse_message(self.recv_frame(timeout))
