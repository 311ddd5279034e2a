"""Every ``python -m <module>`` command that README.md or docs/*.md shows answers ``--help``.

The modules are read from the documentation itself, so a module that is renamed or moved
while the docs still show its old name fails here. Each module runs as ``python -m`` runs it
(:func:`runpy.run_module` with ``run_name="__main__"`` and ``alter_sys=True``, argv
``[<module>, "--help"]``); to share the imports (torch alone costs seconds), the modules run
in two worker processes, a few after one another in each, each worker under a time limit (a
module that ignores ``--help`` and starts its work runs into it).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: ``python -m <module>``, ``python3 -m …`` and ``.venv/bin/python -m …`` alike
COMMAND = re.compile(r"\bpython3? -m ([A-Za-z_][\w.]*)")
WORKERS = 2
TIMEOUT_S = 240

#: Runs the modules named on its command line with ``--help``, one JSON line per module.
DRIVER = r"""
import contextlib, io, json, runpy, sys
for module in sys.argv[1:]:
    out = io.StringIO()
    code = None
    sys.argv = [module, "--help"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) or exc.code is None else 1
    except BaseException as exc:  # an import error, a crash: reported, the others still run
        code = f"{type(exc).__name__}: {exc}"
    text = out.getvalue()
    print(json.dumps({"module": module, "code": code or 0, "usage": "usage" in text.lower(),
                      "output": text[-2000:]}), flush=True)
"""


def documented_modules() -> dict[str, list[str]]:
    """Module → the documentation files that show ``python -m <module>``."""
    found: dict[str, list[str]] = {}
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for module in COMMAND.findall(page.read_text(encoding="utf-8")):
            found.setdefault(module.rstrip("."), []).append(page.relative_to(REPO).as_posix())
    return found


def _run(modules: list[str]) -> list[dict]:
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, *modules],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    answered = {r["module"] for r in lines}
    for module in modules:
        if module not in answered:  # the worker died on this module
            lines.append(
                {"module": module, "code": done.returncode, "usage": False, "output": done.stderr}
            )
    return lines


def test_docs_show_the_project_commands() -> None:
    modules = documented_modules()
    assert "simulations.run_local" in modules and "simulations.mpu_attack" in modules
    assert COMMAND.findall("`.venv/bin/python -m simulations.sweep --help`") == [
        "simulations.sweep"
    ]


def test_every_documented_module_answers_help() -> None:
    modules = documented_modules()
    names = sorted(modules)
    groups = [names[i::WORKERS] for i in range(WORKERS)]
    with ThreadPoolExecutor(WORKERS) as pool:
        results = [r for rows in pool.map(_run, groups) for r in rows]
    failed = [
        f"python -m {r['module']} --help (shown in {', '.join(sorted(set(modules[r['module']])))})"
        f" gave {r['code']!r}: {r['output'][-500:]}"
        for r in results
        if r["code"] != 0 or not r["usage"]
    ]
    assert not failed, "\n".join(failed)
    assert sorted(r["module"] for r in results) == names
