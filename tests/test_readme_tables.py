"""The README's model and format tables are generated from the registries
(scripts/readme_tables.py) and must equal them: a model type or a format added to the code
without its README row fails here."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("readme_tables", ROOT / "scripts" / "readme_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_tables_equal_the_registries():
    rt = _script()
    readme = (ROOT / "README.md").read_text()
    assert rt.readme_block(readme) == rt.tables(), "README tables are stale: python scripts/readme_tables.py --write"


def test_every_registered_model_type_and_format_has_a_row():
    """Read back from the README's text itself (not the generator), against the registries."""
    from freetoken_py.formats import LATER, LOADS
    from freetoken_py.models import supported_model_types

    rt = _script()
    block = rt.readme_block((ROOT / "README.md").read_text())
    first_cells = [line.split(" | ")[0] for line in block.splitlines() if line.startswith("| `") and "`model_type`" not in line]
    listed = {t for cell in first_cells for t in re.findall(r"`([a-z0-9_]+)`", cell)}
    assert listed == set(supported_model_types())
    assert all(f"| {f} | yes" in block for f in LOADS) and all(name in block for name in LATER.values())
