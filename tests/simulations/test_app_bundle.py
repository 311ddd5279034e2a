"""The staged app folder holds exactly the files Flower bundles from the repository."""

from pathlib import Path

from flwr.cli.utils import collect_files, filter_paths_for_publish

from simulations.app_bundle import app_files, stage_app
from simulations.run_local import REPO_ROOT


def test_app_files_of_the_repository_are_flowers_own_selection():
    # Flower's walk visits every file (the virtual environment too) and filters afterwards
    assert app_files(REPO_ROOT) == sorted(filter_paths_for_publish(collect_files(REPO_ROOT)))
    assert "strategies/server_app.py" in app_files(REPO_ROOT)


def _write(path: Path, text: str = "x = 1\n") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_staging_copies_the_bundled_files_and_skips_ignored_folders(tmp_path):
    project = tmp_path / "project"
    _write(project / ".gitignore", "outputs/\n.venv/\n*.log\n")
    _write(project / "pyproject.toml", "[project]\nname = 'p'\n")
    _write(project / "pkg" / "mod.py")
    _write(project / "pkg" / "data.json", "{}")
    _write(project / "pkg" / "run.log")
    _write(project / "outputs" / "result.py")
    _write(project / ".venv" / "lib" / "site.py")
    (project / "linked").symlink_to(project / "pkg")
    expected = [".gitignore", "pkg/data.json", "pkg/mod.py", "pyproject.toml"]
    assert app_files(project) == expected
    assert app_files(project) == sorted(filter_paths_for_publish(collect_files(project)))

    staged = stage_app(project, tmp_path / "staged")
    _write(staged / "stale.py")  # a later staging replaces the earlier copy
    staged = stage_app(project, tmp_path / "staged")
    found = sorted(p.relative_to(staged).as_posix() for p in staged.rglob("*") if p.is_file())
    assert found == expected
    assert (staged / "pkg" / "mod.py").read_text() == "x = 1\n"
