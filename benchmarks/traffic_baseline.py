"""The original's design for model traffic, rebuilt for the real-traffic benchmark.

`OriginalDesignAgent` is a harbor agent built the way the original was: `run()` hands the
episode to a process-wide `ThreadPoolExecutor` grown to the agent's concurrency; the
episode is a plain loop in that thread which calls the model with the synchronous SDK
(one `anthropic.Anthropic` client per process and configuration, its connection pool
sized to the concurrency) right in the thread, runs each `bash` call on harbor's loop with
`asyncio.run_coroutine_threadsafe(environment.exec(...), loop).result()`, stops at
`submit` and writes its trace (`wmo-run.json`) from the thread. When harbor cancels
`run()`, the episode is flagged to stop before its next model call and waited for.
`setup()` does nothing, as the original's did.

It takes the same `provider_config` as wmo_trio's agent (`anthropic` with `base_url` and
`api_key_env`, or `scripted` with a `script` whose replies carry `latency_s`, slept in the
episode's thread). It imports nothing from wmo_trio, so it measures the same thing before
and after wmo_trio's model I/O changes. Its loop is lean (no step models, no usage
callbacks): a floor for the original design rather than a copy of the original's code.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from harbor.agents.base import BaseAgent

SYSTEM_PROMPT = ("You are an agent working in a Linux task environment. Use the tools to do "
                 "the task, then call submit with your answer.")
MAX_TURNS = 20


def _tool(name: str, description: str, **arguments: str) -> dict[str, Any]:
    return {"name": name, "description": description, "input_schema": {
        "type": "object", "required": list(arguments), "additionalProperties": False,
        "properties": {key: {"type": "string", "description": text} for key, text in arguments.items()}}}


TOOLS = [
    _tool("bash", "Run a shell command in the task environment; returns stdout, then stderr.",
          command="the command line, run by bash"),
    _tool("read_file", "Print a file of the task environment.", path="the file's path"),
    _tool("write_file", "Create or replace a file of the task environment with this content.",
          path="the file's path", content="the whole new content"),
    _tool("submit", "End the episode with your final answer.", answer="the final answer"),
]

# A model call: the conversation so far -> (the reply's content blocks, its usage).
Model = Callable[[list[dict[str, Any]]], tuple[list[dict[str, Any]], dict[str, int]]]


def request_body(model: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """What the episode sends for one call (also the SDK-cost loop's request)."""
    return {"model": model, "max_tokens": 4096, "tools": TOOLS, "messages": messages,
            "system": [{"type": "text", "text": SYSTEM_PROMPT}]}


class SdkModel:
    """The Messages API through one synchronous client shared by every episode thread."""

    def __init__(self, *, base_url: str, api_key: str, model: str, connections: int) -> None:
        import anthropic
        import httpx2  # the SDK's HTTP library: its pool limits

        self.model = model
        limits = httpx2.Limits(max_connections=connections, max_keepalive_connections=connections)
        self.client = anthropic.Anthropic(
            api_key=api_key, base_url=base_url, max_retries=0,
            http_client=anthropic.DefaultHttpxClient(limits=limits))

    def __call__(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, int]]:
        reply = self.client.messages.create(**request_body(self.model, messages))
        content: list[dict[str, Any]] = []
        for block in reply.content:
            if block.type == "tool_use":
                content.append({"type": "tool_use", "id": block.id, "name": block.name,
                                "input": block.input})
            elif block.type == "text":
                content.append({"type": "text", "text": block.text})
        return content, {"input_tokens": reply.usage.input_tokens,
                         "output_tokens": reply.usage.output_tokens}

    def close(self) -> None:
        self.client.close()


class ScriptedModel:
    """Replies from a script (wmo_trio's scripted provider format: `tool_calls`, `latency_s`,
    `usage`), the k-th reply for the k-th call of an episode; the latency is slept in the
    episode's thread, as the original's offline provider did."""

    def __init__(self, script: list[dict[str, Any]]) -> None:
        self.script = script

    def __call__(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, int]]:
        turn = sum(1 for message in messages if message["role"] == "assistant")
        reply = self.script[min(turn, len(self.script) - 1)]
        time.sleep(float(reply.get("latency_s") or 0.0))
        content = [{"type": "tool_use", "id": f"call_{turn}_{index}", "name": call["name"],
                    "input": call.get("arguments", {})}
                   for index, call in enumerate(reply.get("tool_calls", []))]
        usage = reply.get("usage") or {}
        return content, {"input_tokens": int(usage.get("input_tokens", 0)),
                         "output_tokens": int(usage.get("output_tokens", 0))}

    def close(self) -> None:
        pass


class BaselineEpisode:
    """One trial's episode; `run` is what the executor's thread runs."""

    def __init__(self, model: Model, environment: Any, loop: asyncio.AbstractEventLoop, *,
                 task_id: str, instruction: str, logs_dir: Path, command_timeout_sec: int) -> None:
        self.model, self.environment, self.loop = model, environment, loop
        self.task_id, self.instruction, self.logs_dir = task_id, instruction, logs_dir
        self.command_timeout_sec = command_timeout_sec
        # Checked before every model call: how the original stopped a timed-out episode.
        self.cancel = threading.Event()

    def run(self) -> str:
        """The episode to its end; its stop reason. The trace is written either way."""
        messages: list[dict[str, Any]] = [{"role": "user", "content": self.instruction}]
        steps: list[dict[str, Any]] = []
        usage = {"input_tokens": 0, "output_tokens": 0, "calls": 0}
        reason, answer = "max_turns", ""
        try:
            for _ in range(MAX_TURNS):
                if self.cancel.is_set():
                    reason = "cancelled"
                    break
                content, call_usage = self.model(messages)
                usage["calls"] += 1
                for key, value in call_usage.items():
                    usage[key] = usage.get(key, 0) + value
                messages.append({"role": "assistant", "content": content})
                results = []
                for block in content:
                    if block["type"] != "tool_use":
                        continue
                    if block["name"] == "submit":
                        reason, answer = "submitted", str(block["input"].get("answer", ""))
                        steps.append({"tool": "submit", "input": block["input"]})
                        break
                    output, is_error = self._tool(block["name"], block["input"])
                    steps.append({"tool": block["name"], "input": block["input"],
                                  "output": output, "is_error": is_error})
                    results.append({"type": "tool_result", "tool_use_id": block["id"],
                                    "content": output, "is_error": is_error})
                if reason == "submitted":
                    break
                if not results:
                    reason = "no_tool_call"
                    break
                messages.append({"role": "user", "content": results})
        except Exception as error:
            reason = f"error:{type(error).__name__}"
        self._write_trace(reason, answer, steps, usage)
        return reason

    def _tool(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        if name != "bash":
            return f"tool {name!r} not available", True
        call = self.environment.exec(str(arguments.get("command", "")),
                                     timeout_sec=self.command_timeout_sec)
        try:
            result = asyncio.run_coroutine_threadsafe(call, self.loop).result()
        except Exception as error:
            return f"environment command failed: {type(error).__name__}: {error}", True
        output = (result.stdout or "") + (result.stderr or "")
        if result.return_code != 0:
            return f"{output}[exit {result.return_code}]", True
        return output, False

    def _write_trace(self, reason: str, answer: str, steps: list[dict[str, Any]],
                     usage: dict[str, int]) -> None:
        trace = {"task_id": self.task_id, "stop_reason": reason, "answer": answer,
                 "turns": len(steps), "steps": steps, "worker_usage": usage}
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        (self.logs_dir / "wmo-run.json").write_text(json.dumps(trace, indent=2))


# -- the agent ------------------------------------------------------------------------------

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_executor_size = 0
_models: dict[str, SdkModel | ScriptedModel] = {}


def episode_executor(workers: int) -> ThreadPoolExecutor:
    """The process-wide pool, replaced by a bigger one when more workers are asked for."""
    global _executor, _executor_size
    with _lock:
        if _executor is None or _executor_size < workers:
            _executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="original-episode")
            _executor_size = workers
        return _executor


def shared_model(config: dict[str, Any], connections: int) -> SdkModel | ScriptedModel:
    """One model (one SDK client) per process and configuration, made on first use."""
    key = json.dumps(config, sort_keys=True)
    with _lock:
        model = _models.get(key)
        if model is None:
            if config["kind"] == "anthropic":
                model = SdkModel(base_url=config["base_url"], api_key=os.environ[config["api_key_env"]],
                                 model=config["model"], connections=connections)
            elif config["kind"] == "scripted":
                model = ScriptedModel(config["script"])
            else:
                raise ValueError(f"provider_config: unknown kind {config['kind']!r}")
            _models[key] = model
        return model


def shutdown() -> None:
    """Let the pool's idle threads go and close the clients (end of a benchmark run)."""
    global _executor, _executor_size
    with _lock:
        if _executor is not None:
            _executor.shutdown(wait=False)
        for model in _models.values():
            model.close()
        _executor, _executor_size = None, 0
        _models.clear()


async def _wait_until_done(future: asyncio.Future[Any]) -> None:
    while not future.done():
        try:
            await asyncio.wait([future])
        except asyncio.CancelledError:
            continue


class OriginalDesignAgent(BaseAgent):  # type: ignore[misc]  # harbor ships no type information
    """See the module docstring."""

    def __init__(self, logs_dir: Path, model_name: str | None = None, *,
                 provider_config: dict[str, Any], episode_workers: int = 64,
                 command_timeout_sec: int = 240, **harbor_kwargs: Any) -> None:
        super().__init__(logs_dir, model_name, **harbor_kwargs)
        self._config = provider_config
        self._workers = episode_workers
        self._command_timeout_sec = command_timeout_sec

    @staticmethod
    def name() -> str:
        return "original-design"

    def version(self) -> str:
        return "0"

    async def setup(self, environment: Any) -> None:
        pass

    async def run(self, instruction: str, environment: Any, context: Any) -> None:
        loop = asyncio.get_running_loop()
        episode = BaselineEpisode(
            shared_model(self._config, self._workers), environment, loop,
            task_id=str(self.context_id or self.session_id or "harbor-task"), instruction=instruction,
            logs_dir=Path(self.logs_dir), command_timeout_sec=self._command_timeout_sec)
        future: Future[str] = episode_executor(self._workers).submit(episode.run)
        waiting = asyncio.wrap_future(future)
        try:
            reason = await asyncio.shield(waiting)
        except asyncio.CancelledError:
            episode.cancel.set()
            await _wait_until_done(waiting)
            raise
        context.metadata = {**(context.metadata or {}), "stop_reason": reason}
