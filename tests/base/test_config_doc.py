"""docs/configuration.md is generated from the config model (eagle_data/config_doc.py): it
must be what the generator prints now, and every config key must have a description."""

from __future__ import annotations

from support import REPO
from eagle_data import config_doc


def test_every_config_key_has_a_description():
    assert config_doc.missing_descriptions() == []


def test_every_config_key_is_in_the_generated_doc():
    text = config_doc.render()
    for dotted, _, model in config_doc.sections():
        for name in model.model_fields:
            assert f"| `{dotted}.{name}` |" in text


def test_docs_configuration_md_is_up_to_date():
    on_disk = (REPO / "docs" / "configuration.md").read_text()
    assert on_disk == config_doc.render(), (
        "docs/configuration.md differs from the config model's descriptions: regenerate it with "
        f"`{config_doc.COMMAND}`")
