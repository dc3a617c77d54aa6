"""The harness document: every validation rule, the derived views, and doc_hash."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wmo_trio.harness import (
    DEFAULT_TOOLS,
    HarnessDoc,
    HarnessError,
    load_harness,
    parse_harness,
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


slugs = st.from_regex(r"\A[a-z0-9]{1,6}(-[a-z0-9]{1,4}){0,2}\Z")
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
