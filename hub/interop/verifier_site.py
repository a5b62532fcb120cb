"""The `sitecustomize` every Python of a Harbor verifier starts with: installed modules come before the agent's files.

Python puts the folder it runs from first on its path (`python3 -m unittest` and `-c` from the working directory,
a script's own folder), so an agent's `unittest.py`, `argparse.py` or `pytest.py` in the working directory ran in
place of the test runner, or of a module it imports, in tests that only read the agent's output (a `unittest.py`
exiting 0 was paid 1.0; red team, 2026-12-07). Harbor runs the agent's files so; agentrl does not.

`run_verifier` uploads this file, with `WORKDIR` set to the agent's working directory, as
`/tmp/agentrl-verifier-site/sitecustomize.py`, and test.sh runs with that folder first on `PYTHONPATH`. At each
Python's start it puts a finder before Python's own: a top-level module found outside the working directory (the
standard library, site-packages, the tests' folder) is imported from there; one found only in the working
directory (the agent's solution) is imported from it as before. Tests that import the agent's code still give it
their process, as in Harbor. The image's own `sitecustomize` (Debian's) runs after it. A Python without
`importlib.machinery` (Python 2) or a test.sh that sets `PYTHONPATH` itself runs as Harbor would.

Inert when imported under any other name (agentrl's own import of this module installs nothing). Kept to syntax
every Python 3 parses.
"""

import os
import sys

WORKDIR = None  # the agent's working directory: `run_verifier` writes it in the uploaded copy
SITE_DIR = "/tmp/agentrl-verifier-site"


def _under_workdir(entry, workdir):
    try:
        real = os.path.realpath(entry or os.getcwd())
    except OSError:
        return False
    return real == workdir or real.startswith(workdir.rstrip(os.sep) + os.sep)


def make_finder(workdir):
    """A meta-path finder that finds top-level modules on the path without `workdir`'s entries first."""
    from importlib.machinery import PathFinder

    workdir = os.path.realpath(workdir)

    class InstalledFirst:
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if path is not None or "." in name:
                return None  # submodules: their package's own path decides
            trusted = [entry for entry in sys.path if not _under_workdir(entry, workdir)]
            if len(trusted) == len(sys.path):
                return None  # nothing of the working directory on the path: Python's own order
            spec = PathFinder.find_spec(name, trusted)
            if spec is None or spec.loader is None:
                return None  # only in the working directory (or a namespace portion): as Python would
            return spec

        @classmethod
        def invalidate_caches(cls):
            return None

    return InstalledFirst


def install(workdir):
    """Put the finder before Python's path finder, then run the image's own `sitecustomize`, if it has one."""
    from importlib.machinery import PathFinder

    finder = make_finder(workdir)
    position = next((index for index, item in enumerate(sys.meta_path) if item is PathFinder), len(sys.meta_path))
    sys.meta_path.insert(position, finder)
    here = os.path.dirname(os.path.realpath(__file__))
    entries = [entry for entry in sys.path if entry and os.path.realpath(entry) != here
               and not _under_workdir(entry, os.path.realpath(workdir))]
    spec = PathFinder.find_spec("sitecustomize", entries)
    if spec is not None and spec.loader is not None:
        import importlib.util

        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if __name__ == "sitecustomize" and WORKDIR:
    try:
        install(WORKDIR)
    except Exception:  # a Python this cannot guard runs as Harbor would
        pass
