"""A real SMTP server (aiosmtpd) in a thread of this process, counting what it accepts.

::

    with SmtpSink() as sink:
        mail = EmailEffects(guard, SmtpSettings(sink.host, sink.port))
        ...
        assert sink.count() == 1

Worker processes that send to it may be SIGKILLed: the sink lives in the test's process, so its
count is the evidence. Faults (:meth:`SmtpSink.fault`), each used ``times`` times:

- ``reject_rcpt`` / ``reject_data``: answer ``code`` to RCPT TO / at the end of DATA (nothing kept);
- ``timeout``: accept and count the message, then wait ``seconds`` before the 250 reply (the client
  times out: the message was delivered, the answer lost);
- ``slow``: wait ``seconds`` before accepting (the message is counted when the wait is over).

Needs ``aiosmtpd`` (in sagaguard's ``dev`` extra).
"""

from __future__ import annotations

import asyncio
import email
import email.policy
import socket
import threading
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

from aiosmtpd.controller import Controller

__all__ = ["Received", "SmtpSink"]


@dataclass(frozen=True, slots=True)
class Received:
    """One message the sink accepted."""

    sender: str
    recipients: tuple[str, ...]
    message_id: str | None
    subject: str | None
    in_reply_to: str | None
    body: str


@dataclass
class _Fault:
    mode: str
    times: int
    seconds: float
    code: int


@dataclass
class _State:
    lock: threading.Lock = field(default_factory=threading.Lock)
    received: list[Received] = field(default_factory=list)
    faults: list[_Fault] = field(default_factory=list)
    sessions: int = 0

    def take(self, *modes: str) -> _Fault | None:
        with self.lock:
            for fault in self.faults:
                if fault.times > 0 and fault.mode in modes:
                    fault.times -= 1
                    return fault
        return None


class _Handler:
    def __init__(self, state: _State) -> None:
        self.state = state

    async def handle_EHLO(
        self, server: Any, session: Any, envelope: Any, hostname: str, responses: list[str]
    ) -> list[str]:
        session.host_name = hostname
        with self.state.lock:
            self.state.sessions += 1
        return responses

    async def handle_RCPT(
        self, server: Any, session: Any, envelope: Any, address: str, options: list[str]
    ) -> str:
        fault = self.state.take("reject_rcpt")
        if fault is not None:
            return f"{fault.code} recipient rejected (injected)"
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        fault = self.state.take("reject_data", "timeout", "slow")
        if fault is not None and fault.mode == "reject_data":
            return f"{fault.code} message rejected (injected)"
        if fault is not None and fault.mode == "slow":
            await asyncio.sleep(fault.seconds)
        raw = envelope.content if isinstance(envelope.content, bytes) else str(envelope.content).encode()
        parsed = email.message_from_bytes(raw, policy=email.policy.default)
        body = parsed.get_body(("plain", "html"))
        received = Received(
            sender=str(envelope.mail_from),
            recipients=tuple(envelope.rcpt_tos),
            message_id=_header(parsed, "Message-ID"),
            subject=_header(parsed, "Subject"),
            in_reply_to=_header(parsed, "In-Reply-To"),
            body=body.get_content().replace("\r\n", "\n") if body is not None else "",
        )
        with self.state.lock:
            self.state.received.append(received)
        if fault is not None and fault.mode == "timeout":
            await asyncio.sleep(fault.seconds)
        return "250 Message accepted for delivery"


def _header(message: Any, name: str) -> str | None:
    value = message.get(name)
    return None if value is None else str(value).strip()


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class SmtpSink:
    """An SMTP server on ``host`` (a free port unless ``port`` is given) that keeps what it accepts.

    Args:
        host: the address to listen on.
        port: the port; 0 picks a free one.
    """

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self._state = _State()
        self._controller: Controller | None = None

    def start(self) -> Self:
        """Start listening. Returns self."""
        if self._controller is None:
            self.port = self.port or _free_port(self.host)
            self._controller = Controller(_Handler(self._state), hostname=self.host, port=self.port)
            self._controller.start()
        return self

    def stop(self) -> None:
        """Stop listening. Idempotent."""
        controller, self._controller = self._controller, None
        if controller is not None:
            controller.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, tp: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def messages(self) -> list[Received]:
        """Every message accepted so far, oldest first."""
        with self._state.lock:
            return list(self._state.received)

    def count(self, message_id: str | None = None) -> int:
        """How many messages were accepted: in all, or with this ``Message-ID``."""
        return sum(1 for m in self.messages if message_id is None or m.message_id == message_id)

    @property
    def sessions(self) -> int:
        """How many SMTP sessions (EHLO) were opened."""
        with self._state.lock:
            return self._state.sessions

    def fault(self, mode: str, *, times: int = 1, seconds: float = 5.0, code: int = 550) -> None:
        """Inject a fault: ``reject_rcpt``, ``reject_data``, ``timeout`` or ``slow`` (see the module).

        Raises:
            ValueError: unknown mode.
        """
        if mode not in ("reject_rcpt", "reject_data", "timeout", "slow"):
            raise ValueError(f"unknown SMTP fault {mode!r}")
        with self._state.lock:
            self._state.faults.append(_Fault(mode, times, seconds, code))

    def reset(self) -> None:
        """Forget every message and fault."""
        with self._state.lock:
            self._state.received.clear()
            self._state.faults.clear()
            self._state.sessions = 0
