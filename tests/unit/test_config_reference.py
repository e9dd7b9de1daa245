"""The configuration reference is generated from the config models (docs/hooks/config_reference.py):
a field without a description would be a blank row, and a field the renderer skipped would be
undocumented, so both fail here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from app.config import AppConfig
from policies.graph_policy import GraphPolicy

ROOT = Path(__file__).resolve().parents[2]


def load_hook():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "docs" / "hooks" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def schemas() -> dict[str, dict]:
    """Every model's JSON schema by name, nested ones included: pydantic walks the models itself, so
    this does not depend on how the hook finds them."""
    found = {}
    for root in (AppConfig, GraphPolicy):
        schema = root.model_json_schema()
        found[root.__name__] = schema
        found.update(schema.get("$defs", {}))
    return found


@pytest.mark.parametrize("model", sorted(schemas()))
def test_every_field_has_a_description(model):
    properties = schemas()[model]["properties"]
    undocumented = [name for name, prop in properties.items() if not prop.get("description", "").strip()]
    assert not undocumented, f"{model}: give these fields Field(description=...): {undocumented}"


def test_reference_names_every_field_under_its_model():
    sections = {s.split("\n", 1)[0]: s for s in ("\n" + load_hook().render()).split("\n### ")[1:]}
    assert set(sections) == set(schemas()), "a model without a table, or a table of no config model"
    for model, schema in schemas().items():
        for name in schema["properties"]:
            assert f"\n| `{name}` |" in sections[model], f"{model}.{name} is missing from the reference"


def test_configuration_page_holds_the_reference():
    hook = load_hook()
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert hook.MARKER in page
    rendered = hook.on_page_markdown(page)
    assert hook.MARKER not in rendered and hook.render() in rendered
