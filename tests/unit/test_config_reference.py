"""docs/config.md is generated from the schema and must stay what the generator makes."""

import msgspec.inspect as mi

from verl_async.launch.config_reference import field_docs, render
from verl_async.schema import RunConfig


def _leaf_keys(struct: mi.StructType, prefix: str = "") -> list[str]:
    """Every dotted key of a config (as YAML spells it): sections are walked into, a list of tagged
    structs (rewards.sources) contributes each kind's fields as ``KEY.N.field``, and a list
    of one kind of struct (distillation.teachers) its fields likewise."""
    keys = []
    for field in struct.fields:
        key = f"{prefix}{field.encode_name}"
        t = field.type
        if isinstance(t, mi.StructType):
            keys += _leaf_keys(t, f"{key}.")
            continue
        keys.append(key)
        items = t.item_type if isinstance(t, mi.ListType) else None
        if isinstance(items, mi.StructType):
            keys += _leaf_keys(items, f"{key}.N.")
        elif isinstance(items, mi.UnionType) and all(
            isinstance(m, mi.StructType) for m in items.types
        ):
            for member in items.types:
                keys.append(f"{key}.N.{member.tag_field}")
                keys += _leaf_keys(member, f"{key}.N.")
    return sorted(set(keys))


def _table_rows(markdown: str) -> dict[str, list[str]]:
    """Key -> the other cells of its row, for every table row whose first cell is a key."""
    rows = {}
    for line in markdown.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_docs_config_md_is_the_generated_reference(repo_root):
    text = (repo_root / "docs/config.md").read_text()
    assert text == render(), (
        "docs/config.md is out of date: python -m verl_async.launch.config_reference > docs/config.md"
    )


def test_every_field_is_documented(repo_root):
    rows = _table_rows((repo_root / "docs/config.md").read_text())
    keys = _leaf_keys(mi.type_info(RunConfig))
    assert "rewards.sources.N.pattern" in keys and "learner.lr" in keys
    assert "distillation.teachers.N.batch_size" in keys
    missing = [k for k in keys if k not in rows]
    assert not missing, f"fields missing from docs/config.md: {missing}"
    undocumented = [k for k in keys if not rows[k][-1]]
    assert not undocumented, f"fields without a docstring in the schema: {undocumented}"


def test_field_docs_reads_the_string_under_each_field():
    import verl_async.schema as schema

    docs = field_docs(schema)
    assert docs["StalenessConfig"]["max"].startswith("eta: no sample older")
    assert "\n" not in docs["WeightsConfig"]["mode"]  # folded onto one line
    assert "prefetch" not in docs["KLConfig"]  # fields belong to their own class only
