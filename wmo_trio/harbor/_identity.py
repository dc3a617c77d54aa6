"""A candidate's identity in harbor's own records: the document's content, not how it was
given, and which trial a trace belongs to.

harbor 0.25 decides what a job may reuse (`harbor run --diff`, source jobs) from each
trial's `lock.json`, and whether a job may be resumed from its `config.json`: both hold the
agent's keyword arguments as written, and `harness=h.json` is the same string after the
file changes. harbor offers an agent no hook for what identifies it there, so this module
is the one place that reaches into harbor for it (`tests/test_harbor_identity.py` fails
when a harbor release moves what it relies on):

- `pin_document`: the agent's preflight writes the document's `doc_hash` into the agent
  configuration harbor is checking, so the job's and every trial's `config.json` and
  `lock.json` record which document ran, and a resumed job's preflight sees the one it
  started with; a `harbor run` into the directory of a job that ran another document is
  refused there too.
- `record_identity_in_locks`: a trial lock of this agent records the document's
  `doc_hash` in place of the `harness` argument, so the same document given as another
  path, or as reformatted JSON, is the same candidate, and a changed one is another.
- `harbor_trial`: the trial an agent runs in, as harbor's `result.json` names it.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harbor.models.job.lock as _lock_module
import harbor.trial.trial as _trial_module
from harbor.agents.factory import AgentFactory
from harbor.models.job.config import JobConfig
from harbor.models.trial.config import AgentConfig, TrialConfig
from harbor.trial.regrade import local_task_name

from wmo_trio._files import read_bounded

log = logging.getLogger("wmo_trio.harbor")

DOC_HASH = "doc_hash"
HARNESS = "harness"
# harbor's job and trial config.json are a few kilobytes; more than this is not harbor's file.
_MAX_CONFIG_BYTES = 1 << 20


def pin_document(kwargs: Mapping[str, Any] | None, doc_hash: str,
                 agent_class: type) -> bool:
    """From an agent's `preflight`: add `doc_hash` to the keyword arguments of the agent
    configuration harbor's `AgentFactory.run_preflight` is checking (the frame that called
    the agent), so everything harbor records from that configuration names the document.
    False when the caller is not harbor's preflight (nothing to pin).

    A `ValueError` when the job's directory already holds a job of `agent_class` that ran
    another document: harbor would resume it, mixing two candidates' trials."""
    code = AgentFactory.run_preflight.__func__.__code__
    frame = sys._getframe(1)
    for _ in range(6):  # the agent's preflight, its super() calls, then harbor's
        if frame is None:
            return False
        if frame.f_code is code:
            config = frame.f_locals.get("config")
            # The same configuration: harbor hands the agent a copy of its kwargs.
            if (isinstance(config, AgentConfig) and kwargs is not None
                    and config.kwargs.get(HARNESS) is kwargs.get(HARNESS)):
                _refuse_another_document(frame.f_back, doc_hash, agent_class)
                config.kwargs[DOC_HASH] = doc_hash
                return True
            return False
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _refuse_another_document(frame: Any, doc_hash: str, agent_class: type) -> None:
    """The job harbor's preflight is for (its caller's `config`, a `JobConfig`), checked
    against the job directory's `config.json`, which harbor resumes when it exists."""
    for _ in range(3):
        if frame is None:
            return
        job = frame.f_locals.get("config")
        if isinstance(job, JobConfig):
            break
        frame = frame.f_back
    else:
        return
    recorded_path = Path(job.jobs_dir) / job.job_name / "config.json"
    try:
        recorded = JobConfig.model_validate_json(read_bounded(recorded_path, _MAX_CONFIG_BYTES))
    except Exception:  # no job there yet, or not one harbor can resume: harbor says so
        return
    ran = {agent.kwargs.get(DOC_HASH) for agent in recorded.agents
           if (found := _agent_class(agent)) is not None and issubclass(found, agent_class)}
    ran.discard(None)
    if ran and doc_hash not in ran:
        raise ValueError(
            f"{recorded_path.parent} holds a job that ran document {', '.join(sorted(ran))}; "
            f"harness is now document {doc_hash}, and harbor would resume that job with it, "
            "mixing two candidates' trials: restore that document, or run this one as a "
            "new job (another --job-name)")


LockIdentity = Callable[[type, Mapping[str, Any]], str | None]


def record_identity_in_locks(document_hash: LockIdentity) -> None:
    """Make every trial lock harbor builds from now on identify an agent by
    `document_hash(agent_class, kwargs)` (its `doc_hash`; None: not this agent, or no
    document to hash) in place of its `harness` argument. Idempotent."""
    for module in (_lock_module, _trial_module):
        original = module.build_trial_lock
        if getattr(original, "_wmo_identity", False):
            continue
        module.build_trial_lock = _with_identity(original, document_hash)


def _with_identity(original: Callable[..., Any], document_hash: LockIdentity) -> Callable[..., Any]:
    @functools.wraps(original)
    def build_trial_lock(*args: Any, **kwargs: Any) -> Any:
        lock = original(*args, **kwargs)
        agent = lock.agent
        agent_class = _agent_class(agent)
        if agent_class is None or HARNESS not in agent.kwargs:
            return lock
        # The document as it is now, not a pin that may be stale (the agent's preflight
        # refuses a pin the document does not match); the pin when it cannot be read. A
        # regrade runs no agent: its trial is the recorded one's, and so is the document.
        pinned = agent.kwargs.get(DOC_HASH)
        if lock.source_trial is not None and pinned is not None:
            doc_hash = pinned
        else:
            doc_hash = document_hash(agent_class, agent.kwargs) or pinned
        if doc_hash is None:
            return lock
        identity = {name: value for name, value in agent.kwargs.items() if name != HARNESS}
        identity[DOC_HASH] = doc_hash
        return lock.model_copy(update={"agent": agent.model_copy(update={"kwargs": identity})})

    build_trial_lock._wmo_identity = True  # type: ignore[attr-defined]
    return build_trial_lock


def _agent_class(agent: Any) -> type | None:
    """The class an agent configuration names, resolved as harbor resolves it (harbor
    imports it for the job anyway); None when it names none."""
    try:
        found = AgentFactory.get_agent_class_from_config(agent)
    except Exception:  # harbor reports a name or import path that fails, at its preflight
        return None
    return found if isinstance(found, type) else None


@dataclass(frozen=True)
class HarborTrial:
    """A trial as harbor's `result.json` names it; None where harbor did not say."""

    trial_id: str | None = None
    trial_name: str | None = None
    task_id: Any = None  # harbor's task id as JSON, as `result.json` writes it
    task_name: str | None = None


def harbor_trial(environment: Any, *, context_id: object, session_id: str | None) -> HarborTrial:
    """The trial `environment` belongs to: harbor's trial `config.json` (beside the agent's
    logs, written before the agent runs) read through harbor's own model, and the task's
    name as harbor gives it. Whatever cannot be read is None: a trace never fails for it."""
    trial_name = session_id.removesuffix("__agent") if session_id else None
    trial_id = str(context_id) if context_id is not None else None
    task_id: Any = None
    task_name: str | None = None
    try:
        path = Path(environment.trial_paths.config_path)
        # harbor's own file, beside directories a trial writes to: never through a link.
        config = TrialConfig.model_validate_json(read_bounded(path, _MAX_CONFIG_BYTES))
        trial_name = config.trial_name
        identifier = config.task.get_task_id()
        task_id = identifier.model_dump(mode="json")
        local = getattr(identifier, "get_local_path", None)
        task_name = local_task_name(local()) if local is not None else identifier.get_name()
    except Exception:
        log.debug("the trial's config.json could not be read; its trace names less", exc_info=True)
    return HarborTrial(trial_id=trial_id, trial_name=trial_name, task_id=task_id,
                       task_name=task_name)
