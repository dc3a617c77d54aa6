"""The harness document: every validation rule, the derived views, and doc_hash."""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import os
import pickle
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from wmo_trio.harbor import WmoTrioHarborAgent
from wmo_trio.harness import (
    DEFAULT_TOOLS,
    MAX_CONTENT_CHARS,
    MAX_DOCUMENT_BYTES,
    MAX_ID_CHARS,
    MAX_NAME_CHARS,
    MAX_NESTING,
    MAX_NUMBER_DIGITS,
    MAX_SURFACES,
    DocumentForm,
    HarnessDoc,
    HarnessError,
    Surface,
    document_form,
    harness_from,
    load_harness,
    parse_harness,
    parse_harness_json,
)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "harness.json"


def surface(id: str, content: str = "x", **extra: Any) -> dict[str, Any]:
    return {"id": id, "kind": id.partition(":")[0], "content": content, **extra}


def doc(*surfaces: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"name": "t", "surfaces": [surface("prompt:core", "be good"), *surfaces], **extra}


def reference_hash(surfaces: list[dict[str, Any]]) -> str:
    """doc_hash computed straight from the contract's text, independently of the module."""

    def b(text: str) -> str:
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()

    lines = []
    for s in sorted(surfaces, key=lambda s: s["id"]):
        line = s["id"] + "\x00" + b(s["content"])
        if s.get("path") is not None:
            line += "\x00path=" + s["path"]
        lines.append(line)
    return b("\n".join(lines))


# -- hash --------------------------------------------------------------------------------


def test_hash_matches_the_contract_formula_for_the_baseline_shape() -> None:
    surfaces = [
        surface("prompt:core", "You are an agent."),
        surface("tool_policy:main", "bash\nread_file\nwrite_file\nsubmit"),
        surface("param:max-turns", "20"),
        surface("param:temperature", "0.7"),
    ]
    assert parse_harness({"name": "baseline", "surfaces": surfaces}).doc_hash == reference_hash(surfaces)


def test_hash_includes_code_paths() -> None:
    code = surface("code:lib-util-py", "x = 1\n", path="lib/util.py")
    data = doc(code)
    assert parse_harness(data).doc_hash == reference_hash(data["surfaces"])
    assert reference_hash(data["surfaces"]) != reference_hash(
        [s if s is not code else {**s, "path": None} for s in data["surfaces"]]
    )


# The slugs of `[a-z0-9]{1,6}(-[a-z0-9]{1,4}){0,2}`, built from parts: `st.from_regex` drew
# the same language at several times the cost, most of these tests' time.
_slug_characters = "abcdefghijklmnopqrstuvwxyz0123456789"
slugs = st.builds(
    lambda head, tail: "-".join([head, *tail]),
    st.text(_slug_characters, min_size=1, max_size=6),
    st.lists(st.text(_slug_characters, min_size=1, max_size=4), max_size=2),
)
texts = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40
)


@st.composite
def documents(draw: st.DrawFn) -> dict[str, Any]:
    prompt_slugs = draw(st.lists(slugs, min_size=1, max_size=3, unique=True))
    skill_slugs = draw(st.lists(slugs, max_size=2, unique=True))
    surfaces = [surface(f"prompt:{s}", draw(texts)) for s in prompt_slugs]
    surfaces += [
        surface(f"skill:{s}", f"---\nname: {s}\ndescription: {draw(texts).strip()[:10]}\n---\n"
                + draw(texts))
        for s in skill_slugs
    ]
    if draw(st.booleans()):
        surfaces.append(surface("param:max-turns", str(draw(st.integers(1, 500)))))
    return {"name": draw(st.text(max_size=10)), "version": draw(st.integers(0, 9)),
            "surfaces": surfaces}


@settings(max_examples=60, deadline=None)
@given(documents(), st.randoms(), st.text(max_size=10), st.integers(0, 99), st.integers(1, 10**6))
def test_hash_ignores_order_name_version_and_budget(
    data: dict[str, Any], rnd: Any, name: str, version: int, budget: int
) -> None:
    original = parse_harness(data)
    shuffled = list(data["surfaces"])
    rnd.shuffle(shuffled)
    budgeted = [{**s, "budget": max(budget, len(s["content"]), 1)} for s in shuffled]
    other = parse_harness({"name": name, "version": version, "surfaces": budgeted})
    assert other.doc_hash == original.doc_hash
    assert [s.id for s in other.surfaces] == sorted(s["id"] for s in data["surfaces"])


@settings(max_examples=60, deadline=None)
@given(documents(), st.data())
def test_hash_changes_with_any_content_change(data: dict[str, Any], draw: st.DataObject) -> None:
    original = parse_harness(data)
    changed = [dict(s) for s in data["surfaces"]]
    index = draw.draw(st.integers(0, len(changed) - 1))
    if changed[index]["kind"] == "param":  # keep it a valid number
        changed[index]["content"] = str(int(changed[index]["content"]) + 1)
    else:
        changed[index]["content"] += draw.draw(st.sampled_from(["!", " ", "\n", "é"]))
    assume_valid = parse_harness({**data, "surfaces": changed})
    assert assume_valid.doc_hash != original.doc_hash
    assert assume_valid.doc_hash == reference_hash(changed)


def test_hash_changes_with_a_code_path_change() -> None:
    a = parse_harness(doc(surface("code:a-py", "x", path="a.py")))
    b = parse_harness(doc(surface("code:a-py", "x", path="a-py")))
    assert a.doc_hash != b.doc_hash


@settings(max_examples=40, deadline=None)
@given(documents())
def test_document_json_round_trip(data: dict[str, Any]) -> None:
    parsed = parse_harness(data)
    again = HarnessDoc.model_validate_json(parsed.model_dump_json())
    assert again == parsed and again.doc_hash == parsed.doc_hash


# -- surfaces ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (surface("prompt:Core"), "slug"),
        (surface("prompt:core-"), "slug"),
        (surface("prompt:a--b"), "slug"),
        ({"id": "prompt:x", "kind": "skill", "content": "x"}, "must start with 'skill:'"),
        ({"id": "x", "kind": "prompt", "content": "x"}, "must start with 'prompt:'"),
        ({"id": "prompt:x", "kind": "essay", "content": "x"}, "kind"),
        (surface("prompt:nul", "a\x00b"), "NUL"),
        (surface("prompt:surrogate", "a\ud800b"), "surrogate"),
        (surface("prompt:long", "abcdef", budget=5), "over its budget of 5"),
        (surface("prompt:budget", "a", budget=0), "budget"),
        (surface("prompt:path", "a", path="a.txt"), "only code surfaces"),
        (surface("code:helper", "x = 1"), "without a path must be 'code:runtime'"),
        (surface("code:a-py", "x", path="/a.py"), "canonical"),
        (surface("code:a-py", "x", path="a.py/"), "canonical"),
        (surface("code:a-py", "x", path="a//py"), "canonical"),
        (surface("code:a-py", "x", path="./a.py"), "canonical"),
        (surface("code:a-py", "x", path="../a.py"), "canonical"),
        (surface("code:a-py", "x", path="a b.py"), "[A-Za-z0-9._-]"),
        (surface("code:doc-json", "x", path="doc.json"), "reserved"),
        (surface("code:aliases-toml", "x", path="aliases.toml"), "reserved"),
        (surface("code:wrong", "x", path="a.py"), "must have id 'code:a-py'"),
        (surface("code:a-b", "x", path="a_b"), "must have id 'code:a_b'"),
        (surface("code:" + "a" * 1030, "x", path="a" * 1030), "1024 UTF-8 bytes"),
    ],
)
def test_invalid_surfaces_are_refused_naming_the_surface(bad: dict[str, Any], message: str) -> None:
    with pytest.raises(HarnessError) as error:
        parse_harness(doc(bad))
    assert message in str(error.value)
    assert f"surface {bad['id']}" in str(error.value)


def test_a_code_surface_path_maps_to_its_id() -> None:
    parsed = parse_harness(doc(surface("code:pkg-mod-py", "x = 1", path="pkg/mod.py")))
    assert parsed.surface("code:pkg-mod-py") is not None


def test_surface_ids_must_be_unique() -> None:
    with pytest.raises(HarnessError, match="appears more than once"):
        parse_harness(doc(surface("prompt:core", "again")))


def test_a_document_needs_a_prompt() -> None:
    with pytest.raises(HarnessError, match="at least one prompt"):
        parse_harness({"name": "t", "surfaces": [surface("param:max-turns", "3")]})


def test_unknown_document_fields_are_refused() -> None:
    with pytest.raises(HarnessError, match=r"(?i)colour: extra inputs"):
        parse_harness(doc(colour="blue"))


def test_version_must_not_be_negative() -> None:
    with pytest.raises(HarnessError, match="version"):
        parse_harness(doc(version=-1))


# -- derived views -----------------------------------------------------------------------


def test_tools_default_to_the_four_basic_tools() -> None:
    assert parse_harness(doc()).tools == DEFAULT_TOOLS


def test_tools_follow_the_policy_skipping_blank_lines() -> None:
    parsed = parse_harness(doc(surface("tool_policy:main", "\n bash \n\nsubmit\n")))
    assert parsed.tools == ("bash", "submit")


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ("bash\npython\nsubmit", "unknown tool 'python'"),
        ("bash\nread_file", "'submit' tool is mandatory"),
        ("bash\nbash\nsubmit", "listed twice"),
        ("submit\nread_skill", "needs at least one skill"),
    ],
)
def test_bad_tool_policies_are_refused(policy: str, message: str) -> None:
    with pytest.raises(HarnessError) as error:
        parse_harness(doc(surface("tool_policy:main", policy)))
    assert message in str(error.value) and "tool_policy:main" in str(error.value)


def test_read_skill_is_added_when_there_are_skills() -> None:
    parsed = parse_harness(doc(surface("skill:git", "---\nname: git\ndescription: use git\n---\nbody")))
    assert parsed.tools == (*DEFAULT_TOOLS, "read_skill")
    assert parsed.skills[0].description == "use git"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("no front matter", "front matter"),
        ("---\nname: other\n---\n", "must equal the slug 'git'"),
        ("---\nname: git\n", "not closed"),
    ],
)
def test_skill_front_matter_must_name_the_skill(content: str, message: str) -> None:
    with pytest.raises(HarnessError) as error:
        parse_harness(doc(surface("skill:git", content)))
    assert message in str(error.value) and "skill:git" in str(error.value)


def test_params_have_their_defaults() -> None:
    params = parse_harness(doc()).params
    assert (params.max_turns, params.max_output_tokens, params.temperature,
            params.max_env_actions) == (20, 4096, 0.7, 40)


def test_params_are_read_from_their_surfaces() -> None:
    params = parse_harness(doc(
        surface("param:max-turns", " 7\n"), surface("param:max-output-tokens", "512"),
        surface("param:temperature", "0"), surface("param:max-env-actions", "3"),
    )).params
    assert (params.max_turns, params.max_output_tokens, params.temperature,
            params.max_env_actions) == (7, 512, 0.0, 3)


@pytest.mark.parametrize(
    ("surface_id", "content"),
    [
        ("param:max-turns", "0"), ("param:max-turns", "2.5"), ("param:max-turns", "ten"),
        ("param:max-output-tokens", "-1"), ("param:max-env-actions", ""),
        ("param:temperature", "2.5"), ("param:temperature", "-0.1"), ("param:temperature", "nan"),
        ("param:temperature", "warm"),
    ],
)
def test_bad_params_are_refused_naming_the_surface(surface_id: str, content: str) -> None:
    with pytest.raises(HarnessError, match=surface_id):
        parse_harness(doc(surface(surface_id, content)))


def test_a_typescript_runtime_is_refused_naming_the_surface() -> None:
    with pytest.raises(HarnessError) as error:
        parse_harness(doc(surface("param:runtime-kind", "pi-node")))
    assert "param:runtime-kind" in str(error.value) and "pi-node" in str(error.value)


def test_the_python_runtime_kind_is_accepted() -> None:
    assert parse_harness(doc(surface("param:runtime-kind", "python"))).runtime_kind == "python"


def test_system_prompt_joins_prompts_in_id_order() -> None:
    parsed = parse_harness({"name": "t", "surfaces": [
        surface("prompt:zeta", "last"), surface("prompt:alpha", "first")]})
    assert parsed.system_prompt == "first\n\nlast"


def test_code_runtime_must_compile() -> None:
    with pytest.raises(HarnessError, match="does not compile"):
        parse_harness(doc(surface("code:runtime", "def run(kit):\n  return (")))


def test_code_runtime_must_define_run() -> None:
    with pytest.raises(HarnessError, match="top-level function 'run'"):
        parse_harness(doc(surface("code:runtime", "def walk(kit):\n    return 'x'\n")))


def test_code_runtime_with_run_is_accepted() -> None:
    source = "def run(kit):\n    return 'done'\n"
    assert parse_harness(doc(surface("code:runtime", source))).runtime_code == source


# -- files -------------------------------------------------------------------------------


def test_the_example_document_is_valid_and_useful() -> None:
    example = load_harness(EXAMPLE)
    assert "submit" in example.tools and example.system_prompt and example.skills


def test_loading_reports_the_file_and_the_surface(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc(surface("param:max-turns", "zero"))))
    with pytest.raises(HarnessError) as error:
        load_harness(path)
    assert str(path) in str(error.value) and "param:max-turns" in str(error.value)


def test_loading_reports_a_field_error_with_the_surface_id(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc(surface("prompt:nul", "a\x00"))))
    with pytest.raises(HarnessError, match=r"surface prompt:nul\.content"):
        load_harness(path)


def test_loading_reports_json_syntax_errors_with_a_position(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{"name": "t",\n "surfaces": [}')
    with pytest.raises(HarnessError, match=r"broken.json is not JSON: line 2"):
        load_harness(path)


def test_loading_a_missing_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(HarnessError, match="cannot read harness document"):
        load_harness(tmp_path / "missing.json")


# -- hostile input: every entry refuses it with one HarnessError, within documented limits ------


def write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def refusal(path: Path) -> str:
    """Load `path`, expect a HarnessError naming it; return the message."""
    with pytest.raises(HarnessError) as error:
        load_harness(path)
    message = str(error.value)
    assert str(path) in message and "\n" not in message
    return message


def test_json_nested_100000_deep_is_refused_naming_the_limit(tmp_path: Path) -> None:
    path = write(tmp_path, "deep.json", "[" * 100_000 + "]" * 100_000)
    assert f"more than {MAX_NESTING} levels deep" in refusal(path)


def test_nesting_up_to_the_limit_reaches_validation_and_one_more_level_does_not() -> None:
    def nested(levels: int) -> str:  # the document object is level 1
        return '{"name": ' + "[" * (levels - 1) + "]" * (levels - 1) + ', "surfaces": []}'

    with pytest.raises(HarnessError) as at_limit:
        parse_harness_json(nested(MAX_NESTING))
    assert "levels deep" not in str(at_limit.value) and "name" in str(at_limit.value)
    with pytest.raises(HarnessError, match=f"more than {MAX_NESTING} levels deep"):
        parse_harness_json(nested(MAX_NESTING + 1))


def test_brackets_and_digits_inside_strings_are_only_text() -> None:
    prompt = '[{"' * 5_000 + "]\\\"}" * 5_000 + "9" * 5_000
    parsed = parse_harness_json(json.dumps(doc(surface("prompt:brackets", prompt))))
    assert parsed.surface("prompt:brackets") == Surface(id="prompt:brackets", kind="prompt",
                                                        content=prompt)


def test_bytes_that_are_not_utf8_are_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "latin1.json", json.dumps(doc()).replace("be good", "café").encode("latin-1"))
    assert "is not UTF-8 text: byte 0xe9" in refusal(path)


def test_an_integer_of_5000_digits_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "bigint.json", json.dumps(doc()).replace('"name"', '"version": '
                                                                    + "9" * 5_000 + ', "name"'))
    assert f"a number of 5,000 digits, over the limit of {MAX_NUMBER_DIGITS}" in refusal(path)


def test_integers_are_bounded_in_digits_and_in_value() -> None:
    text = json.dumps(doc(version=1))
    with pytest.raises(HarnessError, match="less than or equal to"):
        parse_harness_json(text.replace('"version": 1', '"version": ' + "9" * MAX_NUMBER_DIGITS))
    with pytest.raises(HarnessError, match=f"over the limit of {MAX_NUMBER_DIGITS}"):
        parse_harness_json(text.replace('"version": 1',
                                        '"version": ' + "9" * (MAX_NUMBER_DIGITS + 1)))
    # A mapping skips the JSON text, not the bound; the error never prints the huge number.
    with pytest.raises(HarnessError, match="version: Input should be less than or equal to"):
        parse_harness(doc(version=10**5000))
    with pytest.raises(HarnessError, match="budget: Input should be less than or equal to"):
        parse_harness(doc(surface("prompt:b", "x", budget=10**5000)))


def test_a_param_of_5000_digits_is_refused_naming_the_surface() -> None:
    with pytest.raises(HarnessError, match=r"surface param:max-turns: '9+'\.\.\. \(5,000 char"):
        parse_harness(doc(surface("param:max-turns", "9" * 5_000)))


@pytest.mark.parametrize("where", ["name", "id", "content", "path", "key"])
def test_a_lone_surrogate_anywhere_is_refused(tmp_path: Path, where: str) -> None:
    data = doc(surface("code:a-py", "x = 1", path="a.py"))
    code = data["surfaces"][1]
    if where == "name":
        data["name"] = "a\udc80b"
    elif where == "key":
        data["\ud800"] = 1
    elif where == "id":
        code["id"] = "code:a\udfffpy"
    else:
        code[where] += "\ud800"
    text = json.dumps(data)  # escapes the surrogate as \udXXX, as a hostile file would
    path = write(tmp_path, "surrogate.json", text)
    message = refusal(path)
    assert "surrogate" in message
    assert where in message if where != "key" else "field name" in message
    with pytest.raises(HarnessError, match="surrogate"):
        parse_harness(data)


def outcome_without_hanging_on(fifo: Path, call: Callable[[], object]) -> object:
    """What `call()` returned or raised. Should it wait on `fifo` for a writer (the defect),
    a writer comes after 10 s (refusing takes milliseconds), and the test fails instead of
    hanging."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as error:
            outcome.append(error)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join()
        pytest.fail(f"waited on the FIFO for a writer, then got {outcome[0]!r}")
    return outcome[0]


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "doc.json"
    os.mkfifo(fifo)
    refused = outcome_without_hanging_on(fifo, lambda: load_harness(fifo))
    assert isinstance(refused, HarnessError), refused
    assert "it is a FIFO (named pipe), not a regular file" in str(refused)


@pytest.mark.parametrize("kind", ["directory", "device"])
def test_directories_and_devices_are_refused(tmp_path: Path, kind: str) -> None:
    path = tmp_path if kind == "directory" else Path("/dev/null")
    assert f"it is a {'directory' if kind == 'directory' else 'character device'}" in refusal(path)


def test_a_file_over_the_size_limit_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "huge.json"
    with path.open("wb") as file:
        file.truncate(MAX_DOCUMENT_BYTES + 1)  # sparse: nothing to write
    assert f"{MAX_DOCUMENT_BYTES + 1:,} bytes, over the limit of {MAX_DOCUMENT_BYTES:,}" \
        in refusal(path)
    with pytest.raises(HarnessError, match="over the limit"):
        parse_harness_json(" " * (MAX_DOCUMENT_BYTES + 1))


def many_surfaces(count: int) -> dict[str, Any]:
    return doc(*(surface(f"param:p{i}", "1") for i in range(count - 1)))


def test_100000_surfaces_are_refused_by_the_surface_limit(tmp_path: Path) -> None:
    data = many_surfaces(100_000)
    path = write(tmp_path, "many.json", json.dumps(data))
    assert f"its limit is {MAX_SURFACES:,} surfaces" in refusal(path)
    with pytest.raises(HarnessError, match=f"100,000 surfaces, over the limit of {MAX_SURFACES:,}"):
        parse_harness(data)


def test_the_surface_count_is_checked_before_any_surface_is_read() -> None:
    with pytest.raises(HarnessError) as error:
        parse_harness({"name": "t", "surfaces": [object()] * (MAX_SURFACES + 1)})
    assert str(error.value) == (f"harness document is invalid: surfaces: {MAX_SURFACES + 1:,} "
                                f"surfaces, over the limit of {MAX_SURFACES:,} per document")
    with pytest.raises(HarnessError, match=f"more than {MAX_SURFACES:,} surfaces"):
        parse_harness({"name": "t", "surfaces": itertools.repeat(object())})


def test_a_document_of_exactly_the_surface_limit_is_valid() -> None:
    parsed = parse_harness_json(json.dumps(many_surfaces(MAX_SURFACES)))
    assert len(parsed.surfaces) == MAX_SURFACES and len(parsed.unknown_params) == MAX_SURFACES - 1


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (doc(surface("prompt:big", "x" * (MAX_CONTENT_CHARS + 1))),
         f"surface prompt:big.content: is {MAX_CONTENT_CHARS + 1:,} characters, over the limit"),
        (doc(name="n" * (MAX_NAME_CHARS + 1)), f"at most {MAX_NAME_CHARS} characters"),
        (doc(surface("prompt:" + "a" * MAX_ID_CHARS)), f"id: String should have at most {MAX_ID_CHARS}"),
    ],
    ids=["content", "name", "id"],
)
def test_text_fields_have_size_limits(data: dict[str, Any], message: str) -> None:
    with pytest.raises(HarnessError) as error:
        parse_harness(data)
    assert message in str(error.value) and len(str(error.value)) < 300


def test_a_surface_content_at_the_limit_is_valid() -> None:
    assert parse_harness(doc(surface("prompt:big", "x" * MAX_CONTENT_CHARS))).system_prompt


def test_nan_and_duplicate_keys_are_refused() -> None:
    with pytest.raises(HarnessError, match="holds NaN, which is not JSON"):
        parse_harness_json('{"name": "t", "version": NaN, "surfaces": []}')
    with pytest.raises(HarnessError, match="key 'name' appears twice"):
        parse_harness_json('{"name": "t", "name": "u", "surfaces": []}')


def test_code_runtime_too_deep_for_the_python_parser_is_refused() -> None:
    for source in ("-" * 100_000 + "1", "f()" + "()" * 50_000):
        with pytest.raises(HarnessError, match="code:runtime is nested too deeply"):
            parse_harness(doc(surface("code:runtime", "def run(kit):\n    return 1\n" + source)))


def test_many_problems_are_summarised_on_one_line() -> None:
    with pytest.raises(HarnessError) as error:
        parse_harness(doc(*(surface(f"prompt:p{i}", "\x00") for i in range(40))))
    assert str(error.value).count("NUL") == 5 and "and 35 more problems" in str(error.value)


def test_a_long_or_strange_value_is_shown_short_and_escaped() -> None:
    with pytest.raises(HarnessError) as error:
        parse_harness(doc(surface("tool_policy:main", "submit\n" + "x\u202e" * 500)))
    message = str(error.value)
    assert "\u202e" not in message and "(1,000 characters)" in message and len(message) < 300


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(["name", "version", "surfaces", "id", "kind", "content",
                                       "path", "budget", "x"]), inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()))
def test_any_bytes_give_a_document_or_one_harness_error(raw: bytes) -> None:
    try:
        parse_harness_json(raw, source="fuzz.json")
    except HarnessError as error:
        assert str(error).startswith("fuzz.json ") and "\n" not in str(error)


@settings(max_examples=200, deadline=None)
@given(documents(), st.data())
def test_a_damaged_document_gives_a_document_or_one_harness_error(
    data: dict[str, Any], draw: st.DataObject
) -> None:
    text = json.dumps(data)
    at = draw.draw(st.integers(0, len(text)))
    damage = draw.draw(st.sampled_from(["[", "]", "{", "}", '"', "\\", ",", "\\ud800", "9" * 30,
                                        "\xff", "NaN"]))
    try:
        parse_harness_json(text[:at] + damage + text[at + draw.draw(st.integers(0, 3)):])
    except HarnessError as error:
        assert "\n" not in str(error)


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_any_json_like_value_gives_a_document_or_one_harness_error(value: Any) -> None:
    try:
        parse_harness(value)
    except HarnessError as error:
        assert "\n" not in str(error)


# -- one entry for every form of document: harness_from, and the harbor agent -----------------


@pytest.mark.parametrize(("value", "form"), [
    (parse_harness(doc()), DocumentForm.DOCUMENT),
    (doc(), DocumentForm.MAPPING),
    (json.dumps(doc()), DocumentForm.JSON_TEXT),
    ("\n  " + json.dumps(doc()), DocumentForm.JSON_TEXT),
    ("{not even json", DocumentForm.JSON_TEXT),
    ("docs/harness.json", DocumentForm.PATH),
    ("./{odd}.json", DocumentForm.PATH),
    ("", DocumentForm.PATH),
    (Path("{odd}.json"), DocumentForm.PATH),
    (b"{}", None),
    (5, None),
    (None, None),
])
def test_one_rule_says_what_names_a_document(value: object, form: DocumentForm | None) -> None:
    # A str is JSON text exactly when it starts with '{' after white space; a Path is a path.
    assert document_form(value) is form


def test_a_file_whose_name_starts_with_a_brace_is_named_by_a_path_or_a_directory_in_front(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    example = load_harness(EXAMPLE)
    write(tmp_path, "{odd}.json", EXAMPLE.read_text())
    monkeypatch.chdir(tmp_path)
    assert harness_from(Path("{odd}.json")) == example
    assert harness_from("./{odd}.json") == example
    with pytest.raises(HarnessError, match=r"^the document \(JSON text\) is not JSON"):
        harness_from("{odd}.json")


def test_harness_from_takes_a_document_a_mapping_json_text_or_a_path(tmp_path: Path) -> None:
    example = load_harness(EXAMPLE)
    text = EXAMPLE.read_text()
    copy = write(tmp_path, "copy.json", text)
    forms: list[object] = [example, json.loads(text), text, "  " + text, str(copy), copy]
    assert all(harness_from(form) == example for form in forms)
    with pytest.raises(HarnessError, match=r"expected a harness document.*got int"):
        harness_from(5)


def test_harness_from_parses_one_content_once_and_a_changed_content_anew() -> None:
    # harbor builds an agent per trial with the same `harness` argument: a mapping or a JSON
    # text is parsed once, and any change to it is a new document with its own hash.
    text = EXAMPLE.read_text()
    mapping = json.loads(text)
    assert harness_from(mapping) is harness_from(json.loads(text))
    assert harness_from(text) is harness_from(text)
    changed = json.loads(text)
    changed["surfaces"][0]["content"] += " Be brief."
    assert harness_from(changed) is not harness_from(mapping)
    assert harness_from(changed).doc_hash != harness_from(mapping).doc_hash
    broken = json.loads(text)
    broken["surfaces"] = []
    for _ in range(2):  # a refusal is not remembered as a document
        with pytest.raises(HarnessError):
            harness_from(broken)


def test_harness_from_reads_a_path_once_per_version_of_its_file(tmp_path: Path) -> None:
    text = EXAMPLE.read_text()
    path = write(tmp_path, "doc.json", text)
    first = harness_from(path)
    assert harness_from(str(path)) is first and harness_from(path) is first
    data = json.loads(text)
    data["surfaces"][0]["content"] += " Be brief."
    path.write_text(json.dumps(data))
    os.utime(path, ns=(1, 1))  # a new version even where the clock is coarse
    rewritten = harness_from(path)
    assert rewritten is not first and rewritten.doc_hash != first.doc_hash
    assert harness_from(path) is rewritten


def test_a_mapping_larger_than_a_document_file_may_be_is_parsed_but_not_kept() -> None:
    # Its canonical text would be the key: over MAX_DOCUMENT_BYTES, nothing that large is kept.
    surfaces = [surface(f"prompt:p{i}", "x" * (MAX_CONTENT_CHARS - 1))
                for i in range(MAX_DOCUMENT_BYTES // MAX_CONTENT_CHARS + 1)]
    big = {"name": "big", "surfaces": surfaces}
    assert harness_from(big) is not harness_from(big)
    assert harness_from(big) == harness_from(big)
    small = doc()
    assert harness_from(small) is harness_from(small)


def test_the_agent_reads_its_model_name_as_a_provider_and_model_without_litellm(
    tmp_path: Path,
) -> None:
    agent = make_agent(tmp_path, load_harness(EXAMPLE))
    assert (agent._parsed_model_provider, agent._parsed_model_name) == ("scripted", "offline")


@pytest.mark.parametrize("value", ["no\x00such.json", "\ud800.json", "x" * 5000])
def test_harness_from_a_path_that_cannot_exist_is_a_harness_error(value: str) -> None:
    with pytest.raises(HarnessError, match="cannot read harness document"):
        harness_from(value)


def make_agent(tmp_path: Path, harness: object) -> WmoTrioHarborAgent:
    return WmoTrioHarborAgent(logs_dir=tmp_path, model_name="scripted/offline", harness=harness,
                              provider_config={"kind": "scripted", "model": "offline"})


@pytest.mark.parametrize("case", ["deep", "latin1", "fifo"])
def test_the_agent_refuses_a_hostile_file_with_a_value_error_naming_harness(
    tmp_path: Path, case: str
) -> None:
    path = tmp_path / f"{case}.json"
    if case == "deep":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif case == "latin1":
        path.write_bytes(json.dumps(doc(name="café"), ensure_ascii=False).encode("latin-1"))
    else:
        os.mkfifo(path)
    refused = outcome_without_hanging_on(path, lambda: make_agent(tmp_path, str(path)))
    assert type(refused) is ValueError, refused
    assert str(refused).startswith("harness: ") and str(path) in str(refused)
    assert refused.__cause__ is None


def test_the_agent_reports_the_hash_of_a_candidate_derived_by_model_copy(tmp_path: Path) -> None:
    parent = load_harness(EXAMPLE)
    surfaces = [s for s in parent.surfaces if s.id != "prompt:style"]
    child = parent.model_copy(update={"surfaces": surfaces})
    agent = make_agent(tmp_path, child)
    fresh = parse_harness({"name": parent.name, "version": parent.version,
                           "surfaces": [s.model_dump() for s in surfaces]})
    assert agent.doc.doc_hash == fresh.doc_hash != parent.doc_hash


# -- derivation, equality, hashing ------------------------------------------------------------


def test_model_copy_with_new_surfaces_gives_the_views_of_those_surfaces() -> None:
    parent = parse_harness(doc(surface("param:max-turns", "5"),
                               surface("skill:git", "---\nname: git\n---\nuse git")))
    kept = [s for s in parent.surfaces if s.id != "skill:git"]
    child = parent.model_copy(update={"surfaces": [*kept, surface("tool_policy:main", "submit")]})
    fresh = parse_harness({"name": "t", "surfaces": [*(s.model_dump() for s in kept),
                                                     surface("tool_policy:main", "submit")]})
    assert child == fresh and child.doc_hash == fresh.doc_hash != parent.doc_hash
    assert (child.tools, child.skills, child.params.max_turns) == (("submit",), (), 5)


def test_model_copy_refuses_a_candidate_without_a_prompt() -> None:
    parent = parse_harness(doc(surface("param:max-turns", "5")))
    no_prompt = [s for s in parent.surfaces if s.kind != "prompt"]
    with pytest.raises(HarnessError, match="candidate derived from 't' is invalid: a document "
                                           "needs at least one prompt surface"):
        parent.model_copy(update={"surfaces": no_prompt})


def test_copies_without_changes_keep_data_and_views() -> None:
    parent = load_harness(EXAMPLE)
    for same in (parent.model_copy(), parent.model_copy(deep=True), copy.copy(parent),
                 copy.deepcopy(parent), pickle.loads(pickle.dumps(parent))):
        assert same == parent and hash(same) == hash(parent)
        assert (same.doc_hash, same.tools, same.skills) == (parent.doc_hash, parent.tools,
                                                           parent.skills)


def test_every_way_around_validation_is_refused() -> None:
    parent = load_harness(EXAMPLE)
    with pytest.raises(TypeError, match=r"model_construct would build an unvalidated HarnessDoc"):
        HarnessDoc.model_construct(name="x", surfaces=[])
    with pytest.raises(TypeError, match=r"model_construct would build an unvalidated Surface"):
        Surface.model_construct(id="prompt:x", kind="prompt", content="\x00")
    with pytest.raises(TypeError, match=r"deprecated copy, which skips validation"):
        parent.copy(update={"surfaces": []})
    with pytest.raises(ValidationError, match="frozen"):
        parent.name = "other"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        parent.surfaces.append(parent.surfaces[0])  # type: ignore[attr-defined]


def test_a_surface_changed_behind_pydantics_back_is_validated_again() -> None:
    bad = Surface(id="prompt:x", kind="prompt", content="fine")
    object.__setattr__(bad, "content", "not\x00fine")
    with pytest.raises(HarnessError, match=r"surface prompt:x\.content: may not contain NUL"):
        load_harness(EXAMPLE).with_surfaces(bad)


def test_surface_model_copy_validates_the_copy() -> None:
    prompt = Surface(id="prompt:x", kind="prompt", content="fine")
    assert prompt.model_copy(update={"content": "better"}).content == "better"
    with pytest.raises(HarnessError, match="copy of surface prompt:x is invalid: content"):
        prompt.model_copy(update={"content": "a\x00"})


def test_surfaces_are_a_tuple_in_python_and_a_list_in_json() -> None:
    parsed = load_harness(EXAMPLE)
    assert isinstance(parsed.surfaces, tuple)
    assert isinstance(json.loads(parsed.model_dump_json())["surfaces"], list)


def test_with_surfaces_replaces_by_id_or_adds() -> None:
    parent = parse_harness(doc(surface("param:max-turns", "5")))
    child = parent.with_surfaces(surface("param:max-turns", "9"),
                                 Surface(id="prompt:more", kind="prompt", content="more"))
    assert child.params.max_turns == 9 and child.system_prompt == "be good\n\nmore"
    assert parent.params.max_turns == 5 and parent.system_prompt == "be good"


def test_with_surfaces_refuses_an_id_given_twice_and_reports_invalid_surfaces() -> None:
    parent = parse_harness(doc())
    with pytest.raises(HarnessError, match="surface 'prompt:x' is given twice"):
        parent.with_surfaces(surface("prompt:x", "a"), surface("prompt:x", "b"))
    with pytest.raises(HarnessError, match=r"surface param:max-turns: '0' is not an integer"):
        parent.with_surfaces(surface("param:max-turns", "0"))
    with pytest.raises(HarnessError, match=r"surface prompt:x\.content: may not contain NUL"):
        parent.with_surfaces(surface("prompt:x", "\x00"))


def test_without_surfaces_removes_existing_ids_only() -> None:
    parent = parse_harness(doc(surface("prompt:extra", "more")))
    assert parent.without_surfaces("prompt:extra").system_prompt == "be good"
    with pytest.raises(HarnessError, match="no surface 'prompt:none' to remove"):
        parent.without_surfaces("prompt:none")
    with pytest.raises(HarnessError, match="at least one prompt surface"):
        parent.without_surfaces("prompt:core", "prompt:extra")


def test_derive_replaces_fields_and_with_no_change_is_the_same_document() -> None:
    parent = parse_harness(doc())
    assert parent.derive() is parent
    renamed = parent.derive(name="u", version=3)
    assert (renamed.name, renamed.version, renamed.doc_hash) == ("u", 3, parent.doc_hash)
    with pytest.raises(HarnessError, match="version"):
        parent.derive(version=-1)


def views(parsed: HarnessDoc) -> tuple[Any, ...]:
    return (parsed.doc_hash, parsed.system_prompt, parsed.skills, parsed.tools, parsed.params,
            parsed.runtime_kind, parsed.runtime_code, parsed.unknown_params,
            [parsed.surface(s.id) for s in parsed.surfaces])


@st.composite
def edits(draw: st.DrawFn, data: dict[str, Any]) -> tuple[str, Any, dict[str, Any]]:
    """One change to `data`: (method, argument, the changed data written out in full)."""
    surfaces = list(data["surfaces"])
    kind = draw(st.sampled_from(["content", "add", "remove", "fields", "all"]))
    if kind == "content":
        index = draw(st.integers(0, len(surfaces) - 1))
        old = surfaces[index]
        new = {**old, "content": str(int(old["content"]) + 1) if old["kind"] == "param"
               else old["content"] + draw(texts)}
        return "with_surfaces", new, {**data, "surfaces": [*surfaces[:index], new,
                                                           *surfaces[index + 1:]]}
    if kind == "add":
        new = draw(st.sampled_from([
            surface("prompt:added", draw(texts)), surface("param:unknown", draw(texts)),
            surface("param:max-env-actions", str(draw(st.integers(1, 99)))),
            surface("tool_policy:main", "bash\nsubmit"),
            surface("code:runtime", "def run(kit):\n    return 'ok'\n"),
        ]))
        kept = [s for s in surfaces if s["id"] != new["id"]]
        return "with_surfaces", new, {**data, "surfaces": [*kept, new]}
    if kind == "remove":
        prompts = [s for s in surfaces if s["kind"] == "prompt"]
        removable = [s for s in surfaces if s["kind"] != "prompt" or len(prompts) > 1]
        if not removable:
            return "derive", {}, data
        gone = draw(st.sampled_from(removable))
        return "without_surfaces", gone["id"], {**data, "surfaces": [s for s in surfaces
                                                                     if s is not gone]}
    if kind == "fields":
        changes = {"name": draw(st.text(max_size=10)), "version": draw(st.integers(0, 10**6))}
        return "derive", changes, {**data, **changes}
    shuffled = draw(st.permutations(surfaces))
    return "model_copy", {"surfaces": shuffled}, {**data, "surfaces": shuffled}


@settings(max_examples=100, deadline=None)
@given(documents(), st.data())
def test_a_derived_document_is_the_same_document_validated_from_scratch(
    data: dict[str, Any], draw: st.DataObject
) -> None:
    parent = parse_harness(data)
    method, argument, expected = draw.draw(edits(data))
    if method == "with_surfaces":
        derived = parent.with_surfaces(argument)
    elif method == "without_surfaces":
        derived = parent.without_surfaces(argument)
    elif method == "derive":
        derived = parent.derive(**argument)
    else:
        derived = parent.model_copy(update=argument)
    scratch = parse_harness(expected)
    assert derived == scratch and hash(derived) == hash(scratch)
    assert views(derived) == views(scratch)
    assert parse_harness(data) == parent  # the parent is untouched


@settings(max_examples=100, deadline=None)
@given(documents(), st.randoms())
def test_equal_documents_are_equal_and_hash_equal(data: dict[str, Any], rnd: Any) -> None:
    shuffled = list(data["surfaces"])
    rnd.shuffle(shuffled)
    one, other = parse_harness(data), parse_harness({**data, "surfaces": shuffled})
    assert one == other and hash(one) == hash(other) and len({one, other}) == 1
    assert {one: "score"}[other] == "score"


@settings(max_examples=100, deadline=None)
@given(documents(), st.text(max_size=10), st.integers(0, 99), st.integers(1, 10**6))
def test_doc_hash_ignores_name_version_and_budget_of_a_derived_document(
    data: dict[str, Any], name: str, version: int, budget: int
) -> None:
    parent = parse_harness(data)
    budgeted = [s.model_copy(update={"budget": max(budget, len(s.content), 1)})
                for s in parent.surfaces]
    child = parent.derive(name=name, version=version, surfaces=budgeted)
    assert child.doc_hash == parent.doc_hash
    assert (child == parent) == (name == data["name"] and version == data["version"]
                                 and all(s.budget is None for s in child.surfaces))


@settings(max_examples=100, deadline=None)
@given(documents(), st.data())
def test_documents_with_different_data_are_unequal(data: dict[str, Any], draw: st.DataObject) -> None:
    parent = parse_harness(data)
    index = draw.draw(st.integers(0, len(parent.surfaces) - 1))
    old = parent.surfaces[index]
    changed = parent.with_surfaces(old.model_copy(update={
        "content": str(int(old.content) + 1) if old.kind == "param" else old.content + "!"}))
    assert changed != parent and changed.doc_hash != parent.doc_hash


# -- unpickling -------------------------------------------------------------------------------

MARK = "original-prompt"


def pickled_with_mark(data: dict[str, Any]) -> bytes:
    marked = {**data, "surfaces": [*data["surfaces"], surface("prompt:zz-mark", MARK)]}
    pickled = pickle.dumps(parse_harness(marked))
    assert MARK.encode() in pickled
    return pickled


@settings(max_examples=100, deadline=None)
@given(documents(), st.sampled_from(range(pickle.HIGHEST_PROTOCOL + 1)))
def test_a_pickled_document_loads_equal_with_the_same_views(
    data: dict[str, Any], protocol: int
) -> None:
    parent = parse_harness(data)
    loaded = pickle.loads(pickle.dumps(parent, protocol=protocol))
    assert loaded == parent and hash(loaded) == hash(parent)
    assert views(loaded) == views(parent)


@settings(max_examples=100, deadline=None)
@given(documents())
def test_a_tampered_pickle_gives_the_views_of_its_surfaces(data: dict[str, Any]) -> None:
    # The same number of bytes, so the pickle stays well-formed: only the content differs.
    tampered = pickled_with_mark(data).replace(MARK.encode(), b"tampered-prompt")
    loaded = pickle.loads(tampered)
    scratch = parse_harness({"name": loaded.name, "version": loaded.version,
                             "surfaces": [s.model_dump() for s in loaded.surfaces]})
    assert loaded.surface("prompt:zz-mark").content == "tampered-prompt"  # type: ignore[union-attr]
    assert views(loaded) == views(scratch)
    assert loaded.doc_hash != parse_harness(data).with_surfaces(
        surface("prompt:zz-mark", MARK)).doc_hash


def test_a_pickle_tampered_into_an_invalid_document_is_refused() -> None:
    tampered = pickled_with_mark(doc()).replace(MARK.encode(), b"original\x00prompt")
    with pytest.raises(HarnessError, match=r"unpickled Surface is invalid: content: may not "
                                           "contain NUL"):
        pickle.loads(tampered)
    two_prompts = pickle.dumps(parse_harness(doc(surface("prompt:aa"), surface("prompt:ab"))))
    duplicated = two_prompts.replace(b"prompt:ab", b"prompt:aa")
    with pytest.raises(HarnessError, match="unpickled HarnessDoc is invalid: surfaces: surface id "
                                           "'prompt:aa' appears more than once"):
        pickle.loads(duplicated)


def test_a_document_built_from_attributes_is_validated_from_them() -> None:
    from types import SimpleNamespace

    parent = parse_harness(doc(surface("param:max-turns", "5")))
    edited = [s.model_copy(update={"content": "9"}) if s.id == "param:max-turns" else s
              for s in parent.surfaces]
    built = HarnessDoc.model_validate(SimpleNamespace(name="t", version=0, surfaces=edited),
                                      from_attributes=True)
    assert built.params.max_turns == 9 and built.doc_hash != parent.doc_hash
    with pytest.raises(ValidationError, match="at least one prompt surface"):
        HarnessDoc.model_validate(SimpleNamespace(name="t", version=0, surfaces=[
            s for s in edited if s.kind != "prompt"]), from_attributes=True)


# -- refusing within a second -----------------------------------------------------------------


def hostile_document(tmp_path: Path, case: str) -> Path:
    valid = doc()
    if case == "deep":
        return write(tmp_path, "deep.json", "[" * 100_000 + "]" * 100_000)
    if case == "latin1":
        return write(tmp_path, "latin1.json",
                     json.dumps(doc(name="café"), ensure_ascii=False).encode("latin-1"))
    if case == "bigint":
        return write(tmp_path, "bigint.json", json.dumps(valid).replace(
            '"name"', '"version": ' + "9" * 5000 + ', "name"'))
    if case == "surrogate":
        return write(tmp_path, "surrogate.json", json.dumps(doc(name="a\ud800b")))
    if case == "many":
        return write(tmp_path, "many.json", json.dumps(many_surfaces(100_000)))
    if case == "wide":
        # As large as a document may be, every surface read, refused only at the end.
        widest = doc(*(surface(f"prompt:p{i}", "x" * (MAX_DOCUMENT_BYTES // MAX_SURFACES - 100))
                       for i in range(MAX_SURFACES - 2)), surface("tool_policy:main", "fly"))
        return write(tmp_path, "wide.json", json.dumps(widest))
    path = tmp_path / "huge.json"
    with path.open("wb") as file:
        file.truncate(MAX_DOCUMENT_BYTES + 1)
    return path


@pytest.mark.parametrize("case", ["deep", "latin1", "bigint", "surrogate", "many", "wide",
                                  "huge"])
def test_a_hostile_document_is_refused_within_a_second_of_cpu(tmp_path: Path, case: str) -> None:
    # CPU time of this thread, which a busy machine does not stretch as it stretches the
    # wall clock: each refusal takes milliseconds; 100,000 surfaces once took 13.7 s.
    path = hostile_document(tmp_path, case)
    started = time.thread_time()
    refusal(path)
    assert time.thread_time() - started < 1.0


@pytest.mark.parametrize("value", ["x" * 200_000, "[" + "1," * 100_000 + "1]"])
def test_a_long_string_that_names_no_file_is_quoted_as_a_short_cut_prefix(
    tmp_path: Path, value: str
) -> None:
    with pytest.raises(HarnessError) as error:
        harness_from(value)
    message = str(error.value)
    assert message.startswith(f"cannot read harness document {value[:20]!r}"[:-1])
    assert f"... ({len(value):,} characters)" in message and len(message) < 400
    assert "read as the path of a JSON file unless it starts with '{'" in message
    with pytest.raises(ValueError, match=r"^harness: cannot read harness document ") as refused:
        make_agent(tmp_path, value)
    assert len(str(refused.value)) < 400
