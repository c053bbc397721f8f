"""What `ray job submit --working-dir .` uploads with the README's runtime_env: every module
of the project, in a copy that imports on its own (on a cluster nothing else is there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import readme
from support import REPO

# Folder names users exclude from uploads or ignore in git; Ray's excludes are gitignore
# patterns, so an unanchored `out/` matches a package folder of that name at any depth.
EXCLUDED_NAMES = {"out", "outputs", "build", "dist", "cache", "data", "logs", "log", "tmp", "temp",
                  "venv", "env", "checkpoints", "wandb", "node_modules"}

IMPORT_EVERY_MODULE = """
import importlib, json, pkgutil, sys
import eagle_data, ray_jobs
files = {}
for package in (eagle_data, ray_jobs):
    files[package.__name__] = package.__file__
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        files[info.name] = importlib.import_module(info.name).__file__
print(json.dumps(files))
"""


def clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}


def tracked_modules() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "--", "eagle_data", "ray_jobs"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split()
    untracked = subprocess.run(["git", "ls-files", "--others", "--exclude-standard", "--", "eagle_data", "ray_jobs"],
                               cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return sorted(f for f in {*listed, *untracked} if f.endswith(".py") and (REPO / f).exists())


def ray_upload(tmp_path: Path, runtime_env: dict) -> Path:
    """The working dir as Ray's job client packs it (its own excludes, .gitignore and the
    runtime_env's), unpacked as a node unpacks it."""
    from ray._private.runtime_env.packaging import create_package, unzip_package
    from ray._private.runtime_env.working_dir import upload_working_dir_if_needed

    package = tmp_path / "package.zip"

    def upload(working_dir, excludes, is_file=False):
        create_package(working_dir, package, include_gitignore=True, excludes=excludes)

    upload_working_dir_if_needed({**runtime_env, "working_dir": str(REPO)}, include_gitignore=True, upload_fn=upload)
    unzip_package(str(package), str(tmp_path / "job"), remove_top_level_directory=False, unlink_zip=False)
    return tmp_path / "job"


def test_no_package_folder_has_a_name_users_exclude():
    folders = [p for p in (REPO / "eagle_data").rglob("*") if p.is_dir() and p.name != "__pycache__"]
    clashing = [str(p.relative_to(REPO)) for p in folders if p.name.lower() in EXCLUDED_NAMES]
    assert clashing == []


def test_the_readme_runtime_env_uploads_every_module_and_the_copy_imports_alone(tmp_path):
    env = readme.runtime_env()
    job = ray_upload(tmp_path, env)
    missing = [f for f in tracked_modules() if not (job / f).is_file()]
    assert missing == [], f"the README's runtime_env {env} leaves out {missing}"
    # The unpacked copy by itself: no PYTHONPATH, no checkout, no installed copy of the project.
    imported = subprocess.run([sys.executable, "-c", IMPORT_EVERY_MODULE], cwd=job, env=clean_env(),
                              capture_output=True, text=True, timeout=300)
    assert imported.returncode == 0, imported.stderr[-3000:]
    files = json.loads(imported.stdout.splitlines()[-1])
    outside = {m: f for m, f in files.items() if not Path(f).resolve().is_relative_to(job.resolve())}
    assert outside == {}
    assert len(files) >= len(tracked_modules())


def test_old_unanchored_excludes_would_have_dropped_a_package_folder(tmp_path):
    """The check above can fail: an unanchored exclude naming a package folder drops it."""
    job = ray_upload(tmp_path, {"excludes": ["/.venv/", "storage/"]})
    assert not (job / "eagle_data" / "storage").exists()
    assert (job / "eagle_data" / "config.py").is_file()


def test_this_environment_does_not_hold_the_project(tmp_path):
    """The tests' venv has the project's dependencies, not the project: an installed copy
    (`pip install -e .`) would quietly supply a module the uploaded job lacks, and a job
    test would pass with code Ray never uploaded. Like a laptop with the `ray` CLI."""
    found = subprocess.run([sys.executable, "-c", "import eagle_data; print(eagle_data.__file__)"], cwd=tmp_path,
                           env=clean_env(), capture_output=True, text=True)
    assert found.returncode != 0, (
        f"eagle_data imports outside the checkout, from {found.stdout.strip()}: uninstall it "
        "(`pip uninstall eagle-data`); `make setup` installs only its dependencies")
    assert (Path(sys.executable).parent / "ray").exists(), "the `ray` CLI the README submits with"
