"""The harbor agent's keyword arguments and every check they get before a trial runs:
`AgentArguments` (the agent's options model, which harbor validates), `parse_arguments`
(the agent's `parse_options`) and `provider_for` (the checks that depend on this process,
then the provider).

Nothing here needs harbor but its options model, plain pydantic: `wmo-trio run` refuses a
bad document, provider, timeout or backend with these very checks before it loads harbor's
job machinery, and the agent (`wmo_trio.harbor.WmoTrioHarborAgent`) makes the same ones.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Self

from harbor.agents.options import AgentOptions
from pydantic import BeforeValidator, ConfigDict, Field, model_validator

from wmo_trio.backends import Backend, BackendChoice, backend_named, resolve_backend
from wmo_trio.engine import DEFAULT_EPISODE_WORKERS
from wmo_trio.harness import HarnessDoc, HarnessError, harness_from
from wmo_trio.providers import (
    OwnedProvider,
    ProviderConfig,
    ProviderConfigError,
    build_provider,
    parse_provider_config,
    portable_provider_config,
)
from wmo_trio.settings import (
    DEFAULT_COMMAND_TIMEOUT_SEC,
    DEFAULT_EPISODE_TIMEOUT_SEC,
    CommandTimeout,
    EpisodeSettings,
    PositiveInt,
    PositiveSeconds,
    not_given,
    refused,
)

AGENT_NAME = "wmo-harness"
DocHash = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$", description="32 lowercase hex digits")]


def _document(value: object) -> HarnessDoc:
    if value is None:
        raise not_given()
    try:
        return harness_from(value)
    except HarnessError as error:
        raise refused(str(error)) from None


def _provider_config(value: object) -> ProviderConfig:
    if value is None:
        raise not_given()
    if isinstance(value, str) and value.lstrip().startswith("{"):
        # harbor's --ak passes a value that does not parse as JSON on as text.
        try:
            json.loads(value)
        except json.JSONDecodeError as error:
            raise refused(f"is not valid JSON: {error.msg} at line {error.lineno} column "
                          f"{error.colno} (character {error.pos}); give a JSON object such as "
                          '{"kind": "scripted", "model": "offline"}') from None
    if not isinstance(value, dict):
        raise refused(f"must be a JSON object with kind and model, got {type(value).__name__}")
    try:
        return parse_provider_config(value)
    except ProviderConfigError as error:
        raise refused(str(error)) from None


class AgentArguments(AgentOptions, EpisodeSettings, BackendChoice):  # type: ignore[misc]
    """The agent's keyword arguments (docs/agent.md, "The agent's keyword arguments"), declared
    once: harbor's options model for the agent (`options_model`), which harbor validates
    at preflight and again in every trial's constructor. The document is parsed
    (`harness_from`) and the provider configuration read (`parse_provider_config`);
    building the provider, and the checks that depend on this process (the model name
    harbor passes, an E2B key), are `provider_for`'s."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid", coerce_numbers_to_str=False)
    settings_noun: ClassVar[str] = "agent argument"
    # harbor's options for every agent (its --base-url and --effort fill two): wmo_trio
    # refuses base_url and reasoning_effort (provider_config holds a provider's settings)
    # and has no web tools to disable, so an unknown argument's hint never offers them.
    settings_not_offered: ClassVar[frozenset[str]] = frozenset(
        {"base_url", "disable_web_search", "reasoning_effort"})

    harness: Annotated[HarnessDoc, BeforeValidator(_document)] = Field(
        description="a harness document (a JSON object, JSON text or the path of a JSON file)")
    provider_config: Annotated[ProviderConfig, BeforeValidator(_provider_config)] = Field(
        description="a JSON object with kind and model")
    doc_hash: DocHash | None = Field(
        default=None, description="the document's doc_hash (32 hex digits): the document must have it")
    command_timeout_sec: CommandTimeout = DEFAULT_COMMAND_TIMEOUT_SEC
    # The harbor agent's name for the budget; the research API's aliases are unknown here.
    episode_timeout_sec: PositiveSeconds = DEFAULT_EPISODE_TIMEOUT_SEC
    episode_workers: PositiveInt = DEFAULT_EPISODE_WORKERS

    @property
    def backend(self) -> Backend:
        """The backend the episodes run on: the one named, or the one the document and
        this machine choose."""
        return backend_named(resolve_backend(self.harness, self.harness_backend))

    @model_validator(mode="after")
    def _document_is_the_pinned_one(self) -> Self:
        if self.doc_hash is not None and self.doc_hash != self.harness.doc_hash:
            raise refused(
                f"doc_hash: this job's agent configuration names document {self.doc_hash}, "
                f"but harness is now document {self.harness.doc_hash}; a job never mixes two "
                "candidates' trials: restore that document, or run this one as a new job "
                "(another --job-name)")
        return self


def parse_arguments(kwargs: Mapping[str, Any] | None) -> AgentArguments:
    """The agent's keyword arguments checked: one line naming each bad argument (an unknown
    one with the closest known name) as a `ValueError`; with no backend named, the one
    the document and this machine choose."""
    arguments: AgentArguments = AgentArguments.parse(kwargs or {})
    for name in ("base_url", "reasoning_effort"):
        if getattr(arguments, name) is not None:
            raise ValueError(f"{name} is not supported by {AGENT_NAME}: its provider "
                             "settings go in provider_config")
    if arguments.harness_backend is None:  # chosen by the document and this machine
        arguments = arguments.model_copy(update={
            "harness_backend": resolve_backend(arguments.harness, None)})
    return arguments


def provider_for(arguments: AgentArguments, model_name: str | None, *,
                 check_model_name: bool = True) -> OwnedProvider:
    """The checks that depend on this process, then the provider for one trial (the
    caller owns it); each failure a `ValueError` naming its argument."""
    config = arguments.provider_config
    if check_model_name:
        check_model_name_matches(model_name, config)
    backend = arguments.backend
    backend.check(backend.settings_for(arguments.backend_settings))
    try:
        return build_provider(config)
    except ProviderConfigError as error:
        raise ValueError(f"provider_config: {error}") from None


def check_model_name_matches(model_name: str | None, config: ProviderConfig) -> None:
    """harbor's model name (`-m`) must be `<kind>/<model>` of `provider_config`."""
    if model_name != config.model_name:
        raise ValueError(
            f"model_name (-m) must be {config.model_name!r} (provider_config kind/model), "
            f"got {model_name!r}"
        )



def portable_arguments(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The agent's keyword arguments as they travel to a worker on another machine (one
    with no view of this one's files): the document inline as its JSON object, the
    provider configuration as `portable_provider_config` makes it. A `ValueError` for what
    cannot travel (a provider's `record` or `replay` file)."""
    portable = dict(kwargs)
    if "harness" in portable:
        portable["harness"] = harness_from(portable["harness"]).model_dump(mode="json")
    if isinstance(portable.get("provider_config"), Mapping):
        portable["provider_config"] = portable_provider_config(portable["provider_config"])
    return portable
