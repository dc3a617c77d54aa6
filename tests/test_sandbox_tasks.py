"""The sandbox builds and runs real harbor tasks: the ones under tests/tasks, each modelled
on a public task, in harbor's own job with its oracle agent, from an empty cache."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from harbor_jobs import run_oracle_job
from support.sandbox import REPO, SANDBOX_MARKS, reward

TASKS = REPO / "tests" / "tasks"

pytestmark = SANDBOX_MARKS


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An image cache shared by this module's jobs, empty at first: builds run from
    nothing, as on a fresh machine."""
    return tmp_path_factory.mktemp("image-cache")


@pytest.fixture(scope="module")
def oracle_job(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> dict[str, Any]:
    results = run_oracle_job(tmp_path_factory.mktemp("task-jobs"), TASKS, concurrency=3,
                             cache_dir=str(cache_dir))
    return {"results": results}


@pytest.mark.slow
@pytest.mark.harbor
def test_the_oracle_solves_every_sandbox_task(oracle_job: dict[str, Any]) -> None:
    results = oracle_job["results"]
    assert sorted(r["task_name"] for r in results.values()) == sorted(
        path.name for path in TASKS.iterdir() if (path / "task.toml").is_file()
    )
    for name, result in results.items():
        assert result["exception_info"] is None, (name, result["exception_info"])
        assert reward(result) == 1.0, name


@pytest.mark.slow
@pytest.mark.harbor
def test_the_tasks_need_run_copy_user_and_entrypoint() -> None:
    keywords = set()
    for dockerfile in TASKS.glob("*/environment/Dockerfile"):
        keywords |= {line.split()[0] for line in dockerfile.read_text().splitlines() if line.strip()}
    assert {"RUN", "COPY", "USER", "ENTRYPOINT"} <= keywords


@pytest.mark.slow
@pytest.mark.harbor
def test_every_image_is_built_once_and_listed(oracle_job: dict[str, Any], cache_dir: Path) -> None:
    from wmo_trio.sandbox import ImageCache

    assert len(oracle_job["results"]) == len(list(TASKS.glob("*/task.toml")))
    listed = ImageCache(cache_dir).entries()
    assert sorted(image.task for image in listed) == sorted(
        path.name for path in TASKS.iterdir() if (path / "task.toml").is_file()
    )
    assert not any(image.in_use for image in listed)


@pytest.mark.slow
@pytest.mark.harbor
def test_concurrent_trials_on_one_port_never_answer_each_other(
    tmp_path: Path, cache_dir: Path, oracle_job: dict[str, Any]
) -> None:
    """Four trials each start a service on port 8081 and must read their own token; a
    fifth, whose ENTRYPOINT starts nothing, must fail its healthcheck rather than be
    answered by another trial's service."""
    assert oracle_job["results"]  # the token-service image is built already
    tasks = tmp_path / "tasks"
    shutil.copytree(TASKS / "token-service", tasks / "token-service")
    silent = tasks / "silent-service"
    shutil.copytree(TASKS / "token-service", silent)
    (silent / "environment" / "entrypoint.sh").write_text('#!/bin/sh\nexec "$@"\n')
    toml = (silent / "task.toml").read_text().replace("start_period_sec = 120.0",
                                                      "start_period_sec = 3.0")
    assert "start_period_sec = 3.0" in toml
    (silent / "task.toml").write_text(toml)

    results = run_oracle_job(tmp_path / "jobs", tasks, attempts=4, concurrency=8,
                             cache_dir=str(cache_dir))

    by_task: dict[str, list[dict[str, Any]]] = {}
    for result in results.values():
        by_task.setdefault(result["task_name"], []).append(result)
    assert [reward(r) for r in by_task["token-service"]] == [1.0] * 4
    assert len(by_task["silent-service"]) == 4
    for result in by_task["silent-service"]:
        assert reward(result) != 1.0
        assert result["exception_info"] is not None
        assert "Healthcheck" in result["exception_info"]["exception_type"] + str(
            result["exception_info"]["exception_message"])
