"""The check that an OpenAI-compatible server is there and serves the model, before any
episode: `check_server` (`GET <base_url>/models`), made by the `openai` kind's
`from_config` once per process and configuration.

It speaks HTTP the way the model calls do: through the SDKs' own HTTP library (httpx, which
the openai SDK is built on), with the process's one TLS context
(`wmo_trio.providers._http.tls_context`), without importing the SDK itself.
"""

from __future__ import annotations

import difflib
import json
import logging
import threading
import urllib.parse
from collections.abc import Mapping
from typing import TYPE_CHECKING

from wmo_trio.providers._base import ProviderConfigError
from wmo_trio.providers._http import tls_context

if TYPE_CHECKING:
    import httpx2

__all__ = ["CHECK_TIMEOUT_S", "check_server"]

log = logging.getLogger("wmo_trio.providers._openai")

# How long the check that the server is there may take: it runs before anything else, once.
CHECK_TIMEOUT_S = 10.0
# What each checked server lists, by server, key and headers: its models' names, or None
# where it gave no list that could be read.
_checked_servers: dict[tuple[object, ...], frozenset[str] | None] = {}
_checked_lock = threading.Lock()
# A model list longer than this is not read (a gateway's list of every model it routes to
# is far shorter), and this many of its names are shown when the model is not among them.
_MODEL_LIST_MAX_BYTES = 16 * 1024 * 1024
_MODELS_SHOWN = 5
_MAX_REDIRECTS = 10
_SKIP = '(or set "check_server": false to skip this check)'


def check_server(base_url: str, api_key: str | None, headers: Mapping[str, str], *,
                 model: str | None = None, key_env: str | None = None) -> None:
    """Ask `GET <base_url>/models` whether an OpenAI-compatible API answers there and
    serves `model`, and raise a `ProviderConfigError` that says what to do when it does not:
    it cannot be reached, it refuses the key (401), nothing is served at that path (404),
    or its list of models is readable and `model` is not in it (see `_serves`). Any other
    answer is a server that is there, and a list that cannot be read says nothing about
    the model: servers differ, and the calls will tell.

    A redirect is followed only to the same origin (scheme, host and port), or from http
    to https on the same host, where httpx keeps the key for the model calls too; one
    elsewhere is not followed (and logged), so neither the key nor the other headers go
    to whatever host it names: the check then has no list to read.

    Blocking, for at most `CHECK_TIMEOUT_S` a request. The server is asked once per
    process for a server, key and headers: harbor's CLI preflight and `wmo-trio run` do it
    before any event loop runs; when a harbor `Job` is created from an asyncio program
    instead, its preflight does it on that loop, before any trial.
    """
    key = (base_url, api_key, tuple(sorted(headers.items())))
    with _checked_lock:
        asked = key in _checked_servers
        models = _checked_servers.get(key)
    if not asked:
        models = _listed_models(base_url, api_key, headers, key_env)
        with _checked_lock:
            _checked_servers[key] = models
    if model is not None and models is not None and not _serves(models, model):
        raise ProviderConfigError(
            f"openai provider: the server at {base_url} does not serve model {model!r}; it "
            f"lists {_some_of(models, model)} (GET {base_url}/models): name one of those, "
            'with -m openai/<model> (or set "check_server": false to skip this check)')


def _listed_models(base_url: str, api_key: str | None, headers: Mapping[str, str],
                   key_env: str | None) -> frozenset[str] | None:
    """The names of the models the server lists, or None; a `ProviderConfigError` when it
    is not there."""
    import httpx2  # the SDKs' HTTP library; a fraction of an SDK's import

    url = f"{base_url}/models"
    # Uncompressed: the list's bound is on what the server sends.
    sent = {"Accept": "application/json", "Accept-Encoding": "identity", **headers}
    if api_key is not None:
        sent["Authorization"] = f"Bearer {api_key}"
    try:
        with httpx2.Client(verify=tls_context(), timeout=CHECK_TIMEOUT_S) as client:
            request = client.build_request("GET", url, headers=sent)
            for _ in range(_MAX_REDIRECTS + 1):
                answer = client.send(request, stream=True)
                try:
                    if not answer.is_redirect:
                        return _listing(answer, url, base_url, key_env)
                    following = answer.next_request
                finally:
                    answer.close()
                if following is None or not _may_carry_the_key(str(request.url), str(following.url)):
                    log.warning("openai provider: GET %s redirects to %s, another host; not "
                                "followed, so the key stays with base_url: if the API is there, "
                                "point base_url at it", request.url,
                                following.url if following is not None else "nowhere")
                    return None  # the redirect itself is the answer: a server is there
                request = following
            return None  # redirected on and on: a server is there, with no list to read
    except httpx2.UnsupportedProtocol:
        return None  # base_url is http(s): a redirect to another scheme, not followed
    except httpx2.TransportError as error:
        reason = _root_cause(error)
        raise ProviderConfigError(
            f"openai provider: cannot reach base_url {base_url} (GET {url}: "
            f"{type(reason).__name__}: {reason}); start the server or correct base_url "
            f"{_SKIP}") from None


def _listing(answer: httpx2.Response, url: str, base_url: str,
             key_env: str | None) -> frozenset[str] | None:
    """The model names of a final answer; None when there is no list to read."""
    import httpx2

    if answer.status_code >= 400:
        _refused(answer.status_code, url, base_url, key_env)
        return None
    body = bytearray()
    try:
        for chunk in answer.iter_bytes():
            body += chunk
            if len(body) > _MODEL_LIST_MAX_BYTES:
                return None
    except httpx2.HTTPError:
        return None  # it answered: it is there, but its list cannot be read
    return _model_names(bytes(body))


def _root_cause(error: BaseException) -> BaseException:
    """The innermost cause of a transport failure (the socket's own error, such as
    `ConnectionRefusedError`): what tells a user what happened."""
    while (inner := error.__cause__ or error.__context__) is not None:
        error = inner
    return error


def _model_names(body: bytes) -> frozenset[str] | None:
    """The `id`s of an OpenAI model list (`{"data": [{"id": ...}, ...]}`); None for a body
    of another shape, or a list without any."""
    try:
        listing = json.loads(body)
    except (ValueError, RecursionError):
        return None
    entries = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(entries, list):
        return None
    names = frozenset(entry["id"] for entry in entries
                      if isinstance(entry, dict) and isinstance(entry.get("id"), str))
    return names or None


def _serves(models: frozenset[str], model: str) -> bool:
    """Whether `model` is one of `models`, as servers name them: Ollama takes `name` for
    the `name:latest` it lists, and OpenRouter takes a variant (`name:nitro`) of a listed
    `name`, so those count as listed too."""
    return model in models or f"{model}:latest" in models or model.split(":", 1)[0] in models


def _some_of(models: frozenset[str], model: str) -> str:
    """A few of `models`, those closest to `model` first."""
    shown = difflib.get_close_matches(model, models, n=_MODELS_SHOWN, cutoff=0.5)
    shown += [name for name in sorted(models) if name not in shown][:_MODELS_SHOWN - len(shown)]
    more = len(models) - len(shown)
    return ", ".join(map(repr, shown)) + (f" and {more} more" if more else "")


def _may_carry_the_key(url: str, location: str) -> bool:
    here, there = urllib.parse.urlsplit(url), urllib.parse.urlsplit(location)
    if (here.scheme, here.hostname, _port(here)) == (there.scheme, there.hostname, _port(there)):
        return True
    return (here.hostname == there.hostname and (here.scheme, _port(here)) == ("http", 80)
            and (there.scheme, _port(there)) == ("https", 443))


def _port(parts: urllib.parse.SplitResult) -> int | None:
    try:
        return parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:  # a port that is not a number
        return None


def _refused(status: int, url: str, base_url: str, key_env: str | None) -> None:
    if status == 401 and key_env is None:
        raise ProviderConfigError(
            f"openai provider: the server at {base_url} wants an API key (GET {url} answered "
            "401); put the key in an environment variable and name it in api_key_env")
    if status == 401:
        raise ProviderConfigError(
            f"openai provider: the server at {base_url} refused the API key in {key_env} "
            f"(GET {url} answered 401); set the right key {_SKIP}")
    if status == 404:
        raise ProviderConfigError(
            f"openai provider: no OpenAI-compatible API at base_url {base_url} (GET {url} "
            "answered 404); the API usually lives under /v1, as in http://localhost:8000/v1 "
            f"{_SKIP}")
