"""A local OpenAI-compatible chat completions server for tests: the real ``openai`` SDK talks to it.

::

    with LocalChatModel() as model:
        client = openai.OpenAI(api_key="sk-local", base_url=model.base_url)
        reply = client.chat.completions.create(model="local", messages=[...], tools=[...])
        assert model.counters()["completions"] == 1

Answers are deterministic in shape and fresh in identity, like a real model's: when the request
offers ``tools`` and the last message is not a tool result, the answer calls the first tool
(``finish_reason="tool_calls"``) with a new random ``call_...`` id; otherwise it answers with text.
So a test can tell a replayed answer (same ids) from a new one (new ids). With a ``script`` (a list
of turns, each a list of ``{"name": ..., "args": {...}}`` tool calls), the answer to a request whose
messages hold *n* assistant messages makes the tool calls of turn *n* (fresh ids), and past the
script a text answer: a model that plans several tools in a row (``LocalChatModel(script=...)``).

Usage is counted as a real server would report it: ``prompt_tokens`` is the request's JSON length
divided by 4, ``completion_tokens`` the answer's. With ``store=true`` the completion is stored with
its ``metadata``, and ``GET /v1/chat/completions?metadata[k]=v`` lists the stored ones
(``GET /v1/chat/completions/{id}`` retrieves one), as OpenAI's stored completions do.

Counters: ``requests``, ``completions`` (answers generated: what you pay for), ``prompt_tokens``,
``completion_tokens``, ``stored``, ``lists``, ``faults_fired``.
"""

from __future__ import annotations

import json
import re
import time
import urllib.parse
import uuid
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from sagaguard.connectors.testing._service import App, LocalService, Reply, Request

__all__ = ["ChatApp", "LocalChatModel"]

_ONE = re.compile(r"^/v1/chat/completions/(?P<id>chatcmpl-\w+)$")
_META = re.compile(r"^metadata\[(?P<key>[^\]]+)\]$")


class ChatApp(App):
    """The request handling of :class:`LocalChatModel`."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.stored: list[dict[str, Any]] = []
        self.count: dict[str, int] = {}

    def _inc(self, name: str, n: int = 1) -> None:
        self.count[name] = self.count.get(name, 0) + n

    def counters(self) -> dict[str, int]:
        return dict(self.count)

    def reset(self) -> None:
        self.stored.clear()
        self.count.clear()

    def handle(self, request: Request) -> Reply:
        with self.lock:
            self._inc("requests")
        if request.method == "POST" and request.path == "/v1/chat/completions":
            try:
                body = json.loads(request.body or b"{}")
            except ValueError:
                return _error(400, "the body is not JSON")
            request.pause()
            return self._complete(body)
        if request.method == "GET" and request.path == "/v1/chat/completions":
            return self._list(request.query)
        one = _ONE.match(request.path)
        if request.method == "GET" and one is not None:
            with self.lock:
                found = next((c for c in self.stored if c["id"] == one["id"]), None)
            return Reply(HTTPStatus.OK, found) if found is not None else _error(404, "no such completion")
        return _error(404, f"no route {request.method} {request.path}")

    def answer(self, body: Mapping[str, Any], messages: list[Any]) -> tuple[dict[str, Any], str | None]:
        """The assistant message for a valid request, and a label to count it under
        (``completions_{label}``; None: only ``completions``). Subclasses answer otherwise.

        Here: the script's turn when there is a script; else the first offered tool is called when
        the last message is not a tool result (a fresh ``call_...`` id each time), else a text answer.
        """
        script = self.config.get("script")
        if script is not None:
            turn = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")
            if turn < len(script):
                calls = [
                    {
                        "id": f"call_{uuid.uuid4().hex[:20]}",
                        "type": "function",
                        "function": {"name": c["name"], "arguments": json.dumps(c.get("args", {}))},
                    }
                    for c in script[turn]
                ]
                return {"role": "assistant", "content": None, "tool_calls": calls}, None
            return {"role": "assistant", "content": f"done after {turn} turns"}, None
        tools = body.get("tools") or []
        last = messages[-1] if isinstance(messages[-1], dict) else {}
        if tools and last.get("role") != "tool":
            function = tools[0].get("function", {})
            call = {
                "id": f"call_{uuid.uuid4().hex[:20]}",
                "type": "function",
                "function": {"name": function.get("name", "tool"), "arguments": "{}"},
            }
            return {"role": "assistant", "content": None, "tool_calls": [call]}, None
        return {"role": "assistant", "content": f"done after {len(messages)} messages"}, None

    def _complete(self, body: Mapping[str, Any]) -> Reply:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not body.get("model"):
            return _error(400, "model and a non-empty messages list are required")
        if body.get("stream"):
            return _error(400, "streaming is not supported by the local server")
        message, label = self.answer(body, messages)
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        prompt = max(1, len(json.dumps(messages)) // 4)
        completion = max(1, len(json.dumps(message)) // 4)
        answer = {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            },
            "metadata": body.get("metadata"),
        }
        with self.lock:
            self._inc("completions")
            if label is not None:
                self._inc(f"completions_{label}")
            self._inc("prompt_tokens", prompt)
            self._inc("completion_tokens", completion)
            if body.get("store"):
                self.stored.append(answer)
                self._inc("stored")
        return Reply(HTTPStatus.OK, answer)

    def _list(self, query: str) -> Reply:
        wanted: dict[str, str] = {}
        params: dict[str, str] = {}
        for name, value in urllib.parse.parse_qsl(query):
            meta = _META.match(name)
            if meta is not None:
                wanted[meta["key"]] = value
            else:
                params[name] = value
        with self.lock:
            self._inc("lists")
            found = [
                c
                for c in self.stored
                if all((c.get("metadata") or {}).get(k) == v for k, v in wanted.items())
            ]
        if params.get("order", "asc") == "desc":
            found.reverse()
        after = params.get("after")
        if after:
            ids = [c["id"] for c in found]
            found = found[ids.index(after) + 1 :] if after in ids else []
        limit = int(params.get("limit") or 20)
        page = found[:limit]
        return Reply(
            HTTPStatus.OK,
            {
                "object": "list",
                "data": page,
                "has_more": len(found) > limit,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
            },
        )


def _error(status: int, message: str) -> Reply:
    return Reply(status, {"error": {"message": message, "type": "invalid_request_error", "code": None}})


class LocalChatModel(LocalService):
    """The OpenAI-compatible server, in its own process (or a thread), as a context manager.

    Args:
        script: the tool calls to make, turn by turn (see the module docstring); None: call the
            first offered tool.
        in_process: run in a thread of this process instead of its own process.
    """

    def __init__(self, *, script: list[list[dict[str, Any]]] | None = None, in_process: bool = False) -> None:
        super().__init__("chat", {} if script is None else {"script": script}, in_process=in_process)

    @property
    def base_url(self) -> str:
        """What to pass as the SDK's ``base_url``."""
        return self.url + "/v1"
