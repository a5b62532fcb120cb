"""The `sitecustomize` every Python of a Harbor verifier starts with: installed modules come before the agent's files.

Python puts the folder it runs from first on its path (`python3 -m unittest` or `-m pytest` from the working
directory, `-c`), so an agent's `unittest.py`, `difflib.py` (which unittest imports), `pytest.py`, a pytest plugin's
name or the `pandas.py` a test imports to read the agent's output ran in place of the image's (a `unittest.py`
exiting 0 was paid 1.0; red team, 2026-12-07). Harbor runs the agent's files so; agentrl does not:

- a top-level module found outside the working directory (the standard library, site-packages, the tests' folder)
  is imported from there, even when the agent's package of that name is a regular one and the installed one a
  namespace package (whose path keeps the working directory out when it is recalculated after the tests change
  `sys.path`); the agent's own modules (found only in the working directory) import as before; the interpreter's
  own folders are never the agent's, even when the working directory is `/`;
- a module of the standard library (`sys.stdlib_module_names`), or a name the standard library and pytest only
  probe for (`PROBES`), never comes from the working directory: an agent's `msvcrt.py` ran whenever anything
  imported `subprocess`, its `org/` whenever `copy` was imported, its `usercustomize.py` at every start;
- distributions (`importlib.metadata`, pytest's `pytest11` plugins) are not looked for in the working directory.

It patches `PathFinder.find_spec` and `find_distributions` themselves, not a finder beside them: pytest's assertion
rewriting asks `PathFinder` directly. What differs from Harbor for an honest solution: a module of the agent's
that has an installed namesake (a `statistics.py`; a project the image installed without `-e` and the agent
fixed in place) is the installed one; a task must install its project editable, as the `pytest` command (which
puts no working directory on the path) needs anyway. Not covered: tests that import and run the agent's code (that
gives it their process), a `PYTHONPATH` naming the working directory (or an empty entry) before this runs (the
interpreter's start imports `encodings` first) set by test.sh itself (the image's own `ENV PYTHONPATH` is
moved behind these rules by the wrapper: `AGENTRL_VERIFIER_PYTHONPATH`), a virtual environment
test.sh creates inside the working directory, Python 2.

`run_verifier` uploads this file, with `WORKDIR` set, as `/tmp/agentrl-verifier-site/sitecustomize.py`, first on
test.sh's `PYTHONPATH`; the image's own `sitecustomize` (Debian's) runs after it. Inert when imported under any
other name (agentrl's own import installs nothing).
"""

import os
import sys

WORKDIR = None  # the agent's working directory: `run_verifier` writes it in the uploaded copy
SITE_DIR = "/tmp/agentrl-verifier-site"
PROBES = frozenset({"org", "java", "__pypy__", "usercustomize", "sitecustomize"})
"""Top-level names the standard library (`copy` probes Jython's `org.python.core`; `site` the start-up hooks) and
pytest (`__pypy__`) import when present, often found nowhere outside the working directory."""


def _under(entry, workdir):
    try:
        real = os.path.realpath(entry or os.getcwd())
    except (OSError, ValueError):
        return False
    return real == workdir or real.startswith(workdir.rstrip(os.sep) + os.sep)


def _keep_outside(locations, outside):
    """A namespace package's path is recalculated from the whole `sys.path` when that changes: keep the working
    directory's entries out of it then too (CPython's `_NamespacePath._path_finder`)."""
    finder = getattr(locations, "_path_finder", None)
    if finder is None:
        return

    def path_finder(name, path):
        return finder(name, outside(path))

    locations._path_finder = path_finder


def _interpreter_dirs():
    """The standard library's and site-packages' folders: never the agent's, even under a working directory of `/`."""
    import site
    import sysconfig

    found = {os.path.realpath(path) for path in (sysconfig.get_path(key) for key in
                                                 ("stdlib", "platstdlib", "purelib", "platlib")) if path}
    try:
        found.update(os.path.realpath(path) for path in site.getsitepackages())
    except Exception:
        pass
    return found


def install(workdir):
    """Patch `PathFinder` (the rules above), then run the image's own `sitecustomize`, if it has one."""
    from importlib.machinery import PathFinder

    workdir = os.path.realpath(workdir)
    interpreter = _interpreter_dirs()
    stdlib_names = frozenset(getattr(sys, "stdlib_module_names", ())) | PROBES
    site_dir = os.path.dirname(os.path.realpath(__file__))
    original_find_spec = PathFinder.find_spec
    original_find_distributions = getattr(PathFinder, "find_distributions", None)
    judged = {}  # (entry, the folder a relative one is relative to) -> the agent's: every import asks again

    def agents(entry):
        key = (entry, "" if os.path.isabs(entry) else os.getcwd())
        if key not in judged:
            judged[key] = _under(entry, workdir) and not any(_under(entry, folder) for folder in interpreter)
        return judged[key]

    def outside(path=None):
        return [entry for entry in (sys.path if path is None else path) if not agents(entry)]

    def find_spec(cls, name, path=None, target=None):
        if path is not None or "." in name:
            return original_find_spec(name, path, target)  # a submodule: its package's path decides
        trusted = outside()
        if len(trusted) == len(sys.path):
            return original_find_spec(name, path, target)  # nothing of the working directory on the path
        spec = original_find_spec(name, trusted, target)
        if spec is None and name in stdlib_names:  # never the agent's
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        if spec is not None and spec.loader is None and spec.submodule_search_locations is not None:
            _keep_outside(spec.submodule_search_locations, outside)  # a namespace package's later recalculations
        return spec if spec is not None else original_find_spec(name, path, target)

    PathFinder.find_spec = classmethod(find_spec)
    moved = os.environ.get("AGENTRL_VERIFIER_PYTHONPATH")  # the image's PYTHONPATH entries in the working directory
    if moved:
        mine = [index for index, entry in enumerate(sys.path) if entry and os.path.realpath(entry) == site_dir]
        position = mine[0] + 1 if mine else len(sys.path)
        sys.path[position:position] = [entry for entry in moved.split(":") if entry]
    if original_find_distributions is not None:
        def find_distributions(cls, *args, **kwargs):
            from importlib.metadata import DistributionFinder

            context = args[0] if args else kwargs.get("context", DistributionFinder.Context())
            if "path" not in vars(context):  # the default search: sys.path, less the working directory
                context = DistributionFinder.Context(name=context.name, path=outside())
            return original_find_distributions(context)

        PathFinder.find_distributions = classmethod(find_distributions)
    entries = [entry for entry in sys.path if entry and os.path.realpath(entry) != site_dir and not agents(entry)]
    spec = original_find_spec("sitecustomize", entries)
    if spec is not None and spec.loader is not None:
        import importlib.util

        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if __name__ == "sitecustomize" and WORKDIR:
    try:
        install(WORKDIR)
    except Exception:  # a Python this cannot guard runs as Harbor would
        pass
