"""Worker-model providers, chosen by `ProviderConfig.kind`.

`build_provider` is the one way the rest of wmo_trio obtains a provider: it validates the
configuration (a bad setting or a missing API key fails here, before any episode runs) and
wraps the provider in wmo_trio's retry policy. Building one is cheap: an SDK is imported,
and its client created, in a worker thread on the first call, never on harbor's loop or on
the trio thread. The one I/O is the `openai` kind's check that its server answers, done by
the first build of a process for a server (see `wmo_trio.providers._openai_check`).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from wmo_trio.providers import _base
from wmo_trio.providers._base import *  # noqa: F403 (the provider interface is this face)
from wmo_trio.providers._base import OwnedProvider, ProviderConfig, ProviderConfigError, ProviderSettings
from wmo_trio.providers._recording import RecordingProvider
from wmo_trio.providers._retry import RetryingProvider, RetryPolicy
from wmo_trio.settings import validation_problem

__all__ = [
    *_base.__all__,
    "build_provider",
    "known_kinds",
    "parse_provider_config",
    "portable_provider_config",
]

# kind -> "module:Class"; classes are imported on first use so that an offline run never
# pays for the SDKs it does not touch.
_REGISTRY: dict[str, str] = {
    "scripted": "wmo_trio.providers._scripted:ScriptedProvider",
    "anthropic": "wmo_trio.providers._anthropic:AnthropicProvider",
    "openai": "wmo_trio.providers._openai:OpenAIProvider",
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
            problems = validation_problem(error, whole="config")
            raise ProviderConfigError(f"invalid provider config: {problems}") from None
    _import_path(config.kind)
    return config


def provider_class(kind: str) -> Any:
    module_name, _, class_name = _import_path(kind).partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def _import_path(kind: str) -> str:
    """Where the class of provider `kind` is; a `ProviderConfigError` naming the known
    kinds when there is no such kind."""
    path = _REGISTRY.get(kind)
    if path is None:
        raise ProviderConfigError(
            f"unknown provider kind {kind!r}; known kinds: {', '.join(known_kinds())}"
        )
    return path


def build_provider(
    data: ProviderConfig | Mapping[str, Any], *, with_retries: bool = True
) -> OwnedProvider:
    """A ready provider for `data`, wrapped in the retry policy unless told otherwise; the
    caller owns it (`with build_provider(data) as provider:` closes it).

    The kind's `from_config` checks every setting, the generic ones (`retry`, `record`)
    included; they are then applied here, around the provider.
    """
    config = parse_provider_config(data)
    provider: OwnedProvider = provider_class(config.kind).from_config(config)
    generic = ProviderSettings.model_validate(
        {name: value for name, value in config.settings.items() if name in ProviderSettings.model_fields})
    if generic.record is not None:
        provider = RecordingProvider(provider, generic.record)
    if with_retries:
        provider = RetryingProvider(provider, RetryPolicy.from_settings(generic.retry))
    return provider


# A scripted provider's script sent to another machine: replies, far less than this.
_MAX_SCRIPT_BYTES = 64 << 20


def portable_provider_config(config: Mapping[str, Any] | ProviderConfig) -> dict[str, Any]:
    """A provider configuration as it travels to a worker process on another machine (one
    with no view of this one's files): a scripted provider's script file inline as its
    replies. A `ProviderConfigError` for a setting that names a file that cannot travel
    (`record`, `replay`)."""
    portable = config.model_dump() if isinstance(config, ProviderConfig) else dict(config)
    for name in ("record", "replay"):
        if portable.get(name) is not None:
            raise ProviderConfigError(
                f"provider_config: {name} names a file of this machine, which worker processes "
                "on other machines do not have; run without workers")
    if isinstance(portable.get("script"), str):
        import json

        from wmo_trio._files import read_bounded
        from wmo_trio.providers._script import load_script

        load_script(portable["script"])  # a bad script is refused here, as in one process
        portable["script"] = json.loads(read_bounded(portable["script"], _MAX_SCRIPT_BYTES))
    return portable
