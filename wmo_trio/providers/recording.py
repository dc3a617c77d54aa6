"""Record provider traffic as JSON lines, and replay it with the scripted provider.

A recording line holds one model call: a `key` that identifies the call within its episode
(the system prompt, the task instruction and the turn number), the full request, and the
response or the error. Replay answers a call with the recorded response of the same key,
so a research run with a real model can be re-run offline with the same replies, even
when several episodes were recorded into one file.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from wmo_trio.providers.base import (
    CallControl,
    Provider,
    ProviderConfigError,
    ProviderError,
    ProviderRequest,
    ProviderResponse,
)
from wmo_trio.providers.script import ScriptedReply, ScriptedToolCall, first_user_message


def call_key(request: ProviderRequest) -> str:
    turn = sum(1 for m in request.messages if m.role == "assistant")
    digest = hashlib.blake2b(digest_size=16)
    digest.update(request.system.encode("utf-8", "surrogatepass"))
    digest.update(b"\x00")
    digest.update(first_user_message(request.messages).encode("utf-8", "surrogatepass"))
    return f"{digest.hexdigest()}:{turn}"


class RecordingProvider:
    """Passes calls through to `inner` and appends each call to a JSONL file."""

    def __init__(self, inner: Provider, path: str | Path) -> None:
        self.inner = inner
        self.config = inner.config
        self.path = Path(path)
        self._lock = threading.Lock()

    def complete(self, request: ProviderRequest, control: CallControl) -> ProviderResponse:
        record: dict[str, Any] = {"key": call_key(request), "request": request.model_dump(mode="json")}
        try:
            response = self.inner.complete(request, control)
        except ProviderError as error:
            record["error"] = {"type": type(error).__name__, "message": str(error),
                               "status": error.status}
            self._append(record)
            raise
        record["response"] = response.model_dump(mode="json")
        self._append(record)
        return response

    def _append(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as file:
                file.write(line)

    def prepare(self) -> None:
        self.inner.prepare()

    def close(self) -> None:
        self.inner.close()


def _as_reply(response: ProviderResponse) -> ScriptedReply:
    return ScriptedReply(
        text=response.text,
        tool_calls=[
            ScriptedToolCall(
                id=call.id,
                name=call.name,
                arguments=call.arguments if call.arguments is not None else (call.raw_arguments or ""),
            )
            for call in response.tool_calls
        ],
        finish_reason=response.finish_reason,
        usage=response.usage,
    )


def load_replay(path: str | Path) -> Callable[[ProviderRequest], ScriptedReply]:
    """Read a recording; the result answers a request with its recorded reply."""
    file = Path(path)
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise ProviderConfigError(f"cannot read recording {file}: {error.strerror}") from None
    replies: dict[str, ScriptedReply] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            key = record["key"]
            if "response" in record:
                replies[key] = _as_reply(ProviderResponse.model_validate(record["response"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValidationError) as error:
            raise ProviderConfigError(
                f"recording {file}, line {number}: not a recorded call ({type(error).__name__})"
            ) from None
    if not replies:
        raise ProviderConfigError(f"recording {file} holds no recorded responses")

    def answer(request: ProviderRequest) -> ScriptedReply:
        key = call_key(request)
        try:
            return replies[key]
        except KeyError:
            raise ProviderError(
                f"replay of {file}: no recorded reply for this episode's turn "
                f"{key.rpartition(':')[2]}"
            ) from None

    return answer
