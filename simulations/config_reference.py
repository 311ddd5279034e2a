"""Write the configuration reference (``docs/config-reference.md``) from the option groups.

    python -m simulations.config_reference            # rewrite docs/config-reference.md
    python -m simulations.config_reference --check    # exit 1 if the file is out of date

Every row comes from the dataclass fields themselves (:class:`strategies.settings.RunSettings`
and the option groups it holds): the key, the default, what the value may be (its rule) and
its help line, so the reference cannot drift from the code.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import Field, fields
from pathlib import Path
from typing import Any

from fedunlearn.options import describe, key_name
from strategies.renamed_keys import RENAMED_KEYS
from strategies.settings import GROUP_TYPES, RunSettings

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "config-reference.md"

HEADER = """# Configuration reference

Generated from the option dataclasses by `python -m simulations.config_reference` (a test
checks that this file is up to date). The run-wide keys sit in `[tool.flwr.app.config]` of
`pyproject.toml`, each group in its own table `[tool.flwr.app.config.<group>]`; Flower
flattens the tables to dotted keys, which is how they are overridden:

```bash
.venv/bin/python -m simulations.run_local \\
    --run-config "gamma=2.0 firm.epsilon=1e-4 scenario.forget-percent=5.0"
```

See [configuration.md](configuration.md) for how runs are configured and checked.
"""


def _default(value: Any) -> str:
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, float) and math.isinf(value):
        return '`"inf"`'
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value}`"


def _rows(prefix: str, options: Any, owner: type) -> list[str]:
    rows = []
    for f in fields(owner):
        if f.name in GROUP_TYPES and owner is RunSettings:
            continue
        rows.append(_row(prefix + key_name(f.name), f, getattr(options, f.name)))
    return rows


def _row(key: str, f: Field, default: Any) -> str:
    help_text = str(f.metadata.get("help", "")).replace("|", "\\|")
    accepts = describe(f).replace("|", "\\|")
    return f"| `{key}` | {_default(default)} | {accepts} | {help_text} |"


def reference() -> str:
    """The whole reference as Markdown."""
    settings = RunSettings()
    table_head = ["| key | default | accepts | meaning |", "|---|---|---|---|"]
    parts = [HEADER, "## Run-wide keys\n", *table_head, *_rows("", settings, RunSettings), ""]
    for name, group in GROUP_TYPES.items():
        doc = " ".join((group.__doc__ or "").strip().split("\n\n")[0].split())
        parts += [f"## `{name}`\n", doc, "", *table_head]
        parts += [*_rows(f"{name}.", getattr(settings, name), group), ""]
    parts += [
        "## Renamed keys\n",
        "The flat keys of earlier versions are refused with the key to use instead:\n",
        "| old key | key now |",
        "|---|---|",
        *(f"| `{old}` | `{new}` |" for old, new in RENAMED_KEYS.items()),
        '| `strategy` | `merge` (a merge), `wrapper = "mpu"` (MPU), `pipeline = "dp2u"` |',
        "",
    ]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that the file is current")
    args = parser.parse_args(argv)
    text = reference()
    if args.check:
        current = REFERENCE.read_text(encoding="utf-8") if REFERENCE.is_file() else ""
        if current != text:
            print(f"{REFERENCE} is out of date: run python -m simulations.config_reference")
            return 1
        return 0
    REFERENCE.write_text(text, encoding="utf-8")
    print(f"wrote {REFERENCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
