"""Worker-model providers, chosen by `ProviderConfig.kind`.

`build_provider` is the one way the rest of wmo_trio obtains a provider: it validates the
configuration (a missing API key fails here, before any episode runs) and wraps the
provider in wmo_trio's retry policy.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from wmo_trio.providers.base import (
    CallControl,
    FinishReason,
    Message,
    Provider,
    ProviderConfig,
    ProviderConfigError,
    ProviderError,
    ProviderInterrupted,
    ProviderRequest,
    ProviderResponse,
    ToolCall,
    ToolSpec,
)

__all__ = [
    "CallControl",
    "FinishReason",
    "Message",
    "Provider",
    "ProviderConfig",
    "ProviderConfigError",
    "ProviderError",
    "ProviderInterrupted",
    "ProviderRequest",
    "ProviderResponse",
    "ToolCall",
    "ToolSpec",
    "build_provider",
    "known_kinds",
    "parse_provider_config",
]

# Settings every provider kind accepts; build_provider handles them around the provider.
GENERIC_SETTINGS = frozenset({"retry", "record"})

# kind -> "module:Class"; classes are imported on first use so that an offline run never
# pays for the SDKs it does not touch.
_REGISTRY: dict[str, str] = {
    "scripted": "wmo_trio.providers.scripted:ScriptedProvider",
    "anthropic": "wmo_trio.providers.anthropic:AnthropicProvider",
}


def known_kinds() -> list[str]:
    return sorted(_REGISTRY)


def register_provider(kind: str, import_path: str) -> None:
    """Make another provider kind available (`import_path` is `module:Class`, the class
    having a `from_config(ProviderConfig)` constructor)."""
    _REGISTRY[kind] = import_path


def parse_provider_config(data: ProviderConfig | Mapping[str, Any]) -> ProviderConfig:
    """Validate a provider configuration, including that its kind exists."""
    if isinstance(data, ProviderConfig):
        config = data
    else:
        try:
            config = ProviderConfig.model_validate(dict(data))
        except ValidationError as error:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in error.errors()
            )
            raise ProviderConfigError(f"invalid provider config: {problems}") from None
    if config.kind not in _REGISTRY:
        raise ProviderConfigError(
            f"unknown provider kind {config.kind!r}; known kinds: {', '.join(known_kinds())}"
        )
    return config


def provider_class(kind: str) -> Any:
    if kind not in _REGISTRY:
        raise ProviderConfigError(
            f"unknown provider kind {kind!r}; known kinds: {', '.join(known_kinds())}"
        )
    module_name, _, class_name = _REGISTRY[kind].partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def build_provider(
    data: ProviderConfig | Mapping[str, Any], *, with_retries: bool = True
) -> Provider:
    """A ready provider for `data`, wrapped in the retry policy unless told otherwise."""
    config = parse_provider_config(data)
    from wmo_trio.providers.retry import RetryingProvider, RetryPolicy

    policy = RetryPolicy.from_settings(config.settings.get("retry"))  # fails before any client
    provider: Provider = provider_class(config.kind).from_config(config)
    record = config.settings.get("record")
    if record is not None:
        from wmo_trio.providers.recording import RecordingProvider

        if not isinstance(record, str) or not record:
            raise ProviderConfigError("record must be the path of a JSONL file to append calls to")
        provider = RecordingProvider(provider, record)
    if with_retries:
        provider = RetryingProvider(provider, policy)
    return provider
