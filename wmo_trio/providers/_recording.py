"""Record provider traffic as JSON lines, and replay it with the scripted provider.

A recording line holds one model call: a `key` that identifies the call within its episode
(the system prompt, the task instruction and the turn number), the full request, and the
response or the error (with the usage the failed attempt counted, if any). Replay answers
a call with the recorded response of the same key, so a research run with a real model
can be re-run offline with the same replies, even when several episodes were recorded into
one file.

Replay counts what the live run counted: the usage of a turn's failed attempts (a reply
without choices counts its call) is added to the response that followed them, and a turn
recorded only as failures (the retry policy gave up) fails again, with their usage, as
its last failure did. A call cut short by its episode's interruption is not replayed: the
replayed episode is not interrupted there.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from wmo_trio.models import TokenUsage
from wmo_trio.providers._base import (
    CallControl,
    ClosesOnExit,
    Provider,
    ProviderConfigError,
    ProviderError,
    ProviderInterrupted,
    ProviderRequest,
    ProviderResponse,
)
from wmo_trio.providers._script import ScriptedReply, ScriptedToolCall, first_user_message


def call_key(request: ProviderRequest) -> str:
    turn = sum(1 for m in request.messages if m.role == "assistant")
    digest = hashlib.blake2b(digest_size=16)
    digest.update(request.system.encode("utf-8", "surrogatepass"))
    digest.update(b"\x00")
    digest.update(first_user_message(request.messages).encode("utf-8", "surrogatepass"))
    return f"{digest.hexdigest()}:{turn}"


class RecordingProvider(ClosesOnExit):
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
            if error.usage is not None:  # this attempt's own: the retry policy adds up later
                record["error"]["usage"] = error.usage.model_dump(mode="json")
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


def _as_reply(response: ProviderResponse, failed: TokenUsage) -> ScriptedReply:
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
        usage=response.usage + failed,
    )


class _Failure(BaseModel):
    """A recorded failed attempt."""

    type: str
    message: str
    status: int | None = None
    usage: TokenUsage | None = None


def load_replay(path: str | Path) -> Callable[[ProviderRequest], ScriptedReply]:
    """Read a recording; the result answers a request with its recorded reply."""
    file = Path(path)
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise ProviderConfigError(f"cannot read recording {file}: {error.strerror}") from None
    replies: dict[str, ScriptedReply] = {}
    # Per key, the failed attempts since its last response: their usage, the last of them.
    failed: dict[str, TokenUsage] = {}
    last_failure: dict[str, _Failure] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            key = record["key"]
            if "response" in record:
                response = ProviderResponse.model_validate(record["response"])
                replies[key] = _as_reply(response, failed.pop(key, TokenUsage()))
                last_failure.pop(key, None)
            elif "error" in record:
                failure = _Failure.model_validate(record["error"])
                if failure.type == ProviderInterrupted.__name__:
                    continue
                failed[key] = failed.get(key, TokenUsage()) + (failure.usage or TokenUsage())
                last_failure[key] = failure
        except (json.JSONDecodeError, KeyError, TypeError, ValidationError) as error:
            raise ProviderConfigError(
                f"recording {file}, line {number}: not a recorded call ({type(error).__name__})"
            ) from None
    if not replies:
        raise ProviderConfigError(f"recording {file} holds no recorded responses")

    def answer(request: ProviderRequest) -> ScriptedReply:
        key = call_key(request)
        if key in replies:
            return replies[key]
        failure = last_failure.get(key)
        if failure is not None:  # the live run gave up here: so does its replay
            raise ProviderError(failure.message, status=failure.status, usage=failed[key])
        raise ProviderError(
            f"replay of {file}: no recorded reply for this episode's turn {key.rpartition(':')[2]}")

    return answer
