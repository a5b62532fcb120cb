"""`agentrl env ...`: create, validate, build, publish, fetch and inspect environment packages.

Every command takes `--hub` (`local`, the default, or `hf`, or a local hub folder) where it
talks to a hub. Heavy work lives in `agentrl.hub`; this module only parses options and
prints results (rich tables), and stays light at import.
"""

from __future__ import annotations

from pathlib import Path

import typer

from agentrl import env_vars

app = typer.Typer(help="Environment packages: init, validate, build, push, pull, list, info, versions, install, "
                       "check, import.", no_args_is_help=True)
import_app = typer.Typer(help="Turn packages of other formats into agentrl packages.", no_args_is_help=True)
app.add_typer(import_app, name="import")

HUB_HELP = "Hub: 'local' (AGENTRL_HUB, default ~/.agentrl/hub), 'hf' (Hugging Face Hub: HF_ENDPOINT, HF_TOKEN), " \
           "or a local hub folder."
REGISTRY_HELP = "OCI registry (host:port) for the sandbox image, e.g. 127.0.0.1:5000; AGENTRL_REGISTRY by default."


def _echo(message: str) -> None:
    typer.echo(message)


def _registry(value: str | None) -> str | None:

    return value or env_vars.REGISTRY.get() or None


@app.command()
def init(
    name: str = typer.Argument(..., help="Environment name (lowercase letters, digits, '-', '_')."),
    directory: Path | None = typer.Option(None, "--dir", help="Folder to create (default: ./NAME)."),
) -> None:
    """Create a working package scaffold (manifest, module, data, README, a test)."""
    from agentrl.hub.scaffold import create_scaffold

    folder = create_scaffold(name, directory=directory)
    _echo(f"created {folder}; try: agentrl env validate {folder}")


@app.command()
def validate(package: str = typer.Argument(".", help="Package folder, or an environment's name (`env list`).")
             ) -> None:
    """Check the manifest, the module, the Dockerfile and every dataset row."""
    from agentrl.hub.loader import find_environment
    from agentrl.hub.package import content_hash, validate_package

    path = find_environment(package)  # a folder, a built-in or an installed package; one line when none
    manifest, splits = validate_package(path)
    sizes = ", ".join(f"{split}={len(rows)}" for split, rows in sorted(splits.items())) or "no splits"
    _echo(f"ok: {manifest.name} {manifest.version} ({sizes}); content hash {content_hash(path)}")


@app.command()
def build(
    path: Path = typer.Argument(Path("."), help="Package folder."),
    out: Path | None = typer.Option(None, help="Output folder (default: PATH/build)."),
    image: bool = typer.Option(True, help="Also build the sandbox image when the package has a Dockerfile."),
) -> None:
    """Build the dataset (parquet through `datasets`) and the sandbox image, without publishing."""
    import shutil

    from agentrl.hub.package import stage_package, validate_package

    manifest, splits = validate_package(path)
    out = out or path / "build"
    if out.exists():
        shutil.rmtree(out)
    digest_note = ""
    if image and manifest.sandbox is not None and manifest.sandbox.dockerfile:
        from agentrl.hub.images import build_image

        image_id = build_image(path, dockerfile=manifest.sandbox.dockerfile,
                               tag=f"{manifest.name}:{manifest.version}", network=manifest.sandbox.network)
        digest_note = f"; image {manifest.name}:{manifest.version} ({image_id[:19]})"
    lock = stage_package(path, out, splits=splits, manifest=manifest)
    _echo(f"built {out}: {len(lock.files)} files, splits {lock.splits}{digest_note}")


@app.command()
def push(
    path: Path = typer.Argument(Path("."), help="Package folder."),
    hub: str | None = typer.Option(None, help=HUB_HELP),
    repo: str | None = typer.Option(None, help="owner/name to publish as (default: <owner>/<manifest name>)."),
    registry: str | None = typer.Option(None, help=REGISTRY_HELP),
    private: bool = typer.Option(False, help="Create the Hugging Face repo as private."),
) -> None:
    """Validate, build and publish a package version (unchanged content is a no-op)."""
    from agentrl.hub.publish import get_hub, push_package
    from agentrl.hub.refs import parse_ref

    owner = name = None
    if repo:
        ref = parse_ref(repo)
        owner, name = ref.owner, ref.name
    result = push_package(path, hub=get_hub(hub, private=private), owner=owner, name=name,
                          registry=_registry(registry), log=_echo)
    state = "published" if result.published else "unchanged"
    image = f" image {result.image}@{result.image_digest}" if result.image_digest else ""
    _echo(f"{state}: {result.ref} {result.content_hash}{image}")


@app.command()
def pull(
    ref: str = typer.Argument(..., help="owner/name[@version] (latest when no version)."),
    hub: str | None = typer.Option(None, help=HUB_HELP),
    to: Path | None = typer.Option(None, help="Folder to pull into (default: the install folder)."),
    image: bool = typer.Option(False, help="Also pull the sandbox image by its recorded digest."),
) -> None:
    """Fetch a package version and verify every file's hash."""
    from agentrl.hub.publish import get_hub, pull_package

    target = pull_package(ref, hub=get_hub(hub), destination=to, pull_image=image, log=_echo)
    _echo(str(target))


@app.command("list")
def list_(
    hub: str | None = typer.Option(None, help=HUB_HELP),
    search: str | None = typer.Option(None, help="Only packages whose name or description contains this."),
    tag: str | None = typer.Option(None, help="Only packages with this tag."),
    installed: bool = typer.Option(False, help="List pulled (installed) packages instead."),
) -> None:
    """List the environments `agentrl.load_environment` finds by name here (built-in, in $AGENTRL_ENV_PATH, pulled
    from a hub), then the packages published to the hub (the local one by default; the latest version of each)."""
    from rich.console import Console
    from rich.table import Table

    if installed:
        from agentrl.hub.refs import list_installed

        for ref in list_installed():
            _echo(str(ref))
        return
    from agentrl.hub.publish import get_hub, list_packages

    if hub in (None, "local"):  # what a user can train on now comes first
        _list_loadable(search, tag)
    rows = list_packages(get_hub(hub), search=search, tag=tag)
    if not rows:
        _echo(f"no packages published to the {hub or 'local'} hub yet (agentrl env push FOLDER publishes one)")
        return
    table = Table("package", "version", "tags", "description", title=f"published to the {hub or 'local'} hub")
    for row in rows:
        table.add_row(row["ref"], row["version"], ", ".join(row["tags"]), row["description"])
    Console(width=160).print(table)


def _list_loadable(search: str | None, tag: str | None) -> None:
    """The environments loadable by name on this machine, with the folder each is loaded from."""
    from rich.console import Console
    from rich.table import Table

    from agentrl.errors import AgentrlError
    from agentrl.hub.loader import list_environments
    from agentrl.hub.manifest import load_manifest

    table = Table("environment", "version", "source", "tags", "folder", title="loadable by name")
    table.columns[-1].overflow = "fold"  # a folder is never cut short
    shown = 0
    for info in list_environments():
        try:
            tags = list(load_manifest(info.path).tags)
        except AgentrlError:
            continue
        if search and search.lower() not in f"{info.name} {info.description}".lower():
            continue
        if tag and tag not in tags:
            continue
        table.add_row(info.name, info.version, info.source, ", ".join(tags), str(info.path))
        shown += 1
    if shown:
        Console(width=200).print(table)


@app.command()
def info(
    ref: str = typer.Argument(..., help="owner/name[@version]."),
    hub: str | None = typer.Option(None, help=HUB_HELP),
) -> None:
    """Show a published version's manifest, content hash, splits and image digest."""
    from agentrl.hub.manifest import MANIFEST_NAME
    from agentrl.hub.publish import get_hub
    from agentrl.hub.refs import parse_ref

    backend = get_hub(hub)
    resolved = backend.resolve(parse_ref(ref))
    lock = backend.lock_of(resolved)
    _echo(f"# {resolved}")
    _echo(f"content_hash = {lock.content_hash}")
    _echo(f"splits = {lock.splits}")
    if lock.image:
        _echo(f"image = {lock.image}@{lock.image_digest}")
    _echo(backend.read_text(resolved, MANIFEST_NAME).rstrip())


@app.command()
def versions(
    ref: str = typer.Argument(..., help="owner/name."),
    hub: str | None = typer.Option(None, help=HUB_HELP),
) -> None:
    """List a package's published versions, oldest first."""
    from agentrl.errors import NotFoundError
    from agentrl.hub.publish import get_hub
    from agentrl.hub.refs import parse_ref

    parsed = parse_ref(ref)
    found = get_hub(hub).versions(parsed)
    if not found:
        raise NotFoundError(f"{parsed.repo_id}: no published versions on this hub")
    for version in found:
        _echo(version)


@app.command()
def install(
    target: str = typer.Argument(..., help="Package folder, or owner/name[@version] of an installed package."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the pip command instead of running it."),
) -> None:
    """Install a package's Python requirements with pip (a verifiers package: into a venv of its own)."""
    from agentrl.hub.install import install_target

    _echo(install_target(target, dry_run=dry_run, log=_echo))


@app.command()
def check(
    target: str = typer.Argument(".", help="Package folder, or owner/name[@version] of an installed package."),
    registry: str | None = typer.Option(None, help="Registry for images named without one."),
) -> None:
    """Report every image the package or its task rows name that its registry (or the engine) lacks."""
    from agentrl.errors import AgentrlError
    from agentrl.hub.images import check_package_images

    results = check_package_images(target, registry=_registry(registry))
    missing = [r for r in results if not r.present]
    for result in results:
        _echo(f"{'ok     ' if result.present else 'MISSING'} {result.image}  ({result.where}; {result.source})")
    if missing:
        raise AgentrlError(f"{len(missing)} of {len(results)} images missing, first: {missing[0].image}; "
                           "push them with `agentrl env push --registry ...` or build them")
    _echo(f"all {len(results)} images present" if results else "the package names no sandbox image")


@import_app.command("harbor")
def import_harbor(
    path: Path = typer.Argument(..., help="Harbor task folder, dataset folder or registry JSON list."),
    out: Path | None = typer.Option(None, help="Package folder to write (default: ./<task name>)."),
    name: str | None = typer.Option(None, help="Environment name (default: from the folder name)."),
    writable_root: str = typer.Option(
        "never",
        help="Phases with a writable root filesystem: never, verifier (a test.sh that installs its tools) or always.",
    ),
    build: bool = typer.Option(False, help="Also build every task's image from its environment/Dockerfile."),
    carry: list[str] | None = typer.Option(
        None,
        help="A folder besides the working directory that the verifier gets from the agent's sandbox (repeatable).",
    ),
    allow_env: list[str] | None = typer.Option(
        None,
        "--allow-env",
        help="A host environment variable the tasks' ${VAR} env templates may take (repeatable; none by default).",
    ),
) -> None:
    """Turn Harbor tasks into an agentrl package whose reward runs each task's tests (one row per task)."""
    from agentrl.errors import AgentrlError
    from agentrl.hub.interop.harbor import build_harbor_images, import_harbor_task

    folder = import_harbor_task(path, out=out, name=name, writable_root=writable_root, carry_paths=carry,
                                allow_env=allow_env, log=lambda line: _echo(f"warning: {line}"))
    if build:
        try:
            for image in build_harbor_images(folder):
                _echo(f"built {image}")
        except AgentrlError as error:  # no package is left behind, so the same import can run again once fixed
            import shutil

            shutil.rmtree(folder)
            raise AgentrlError(f"{path}: an image did not build, so {folder} was not kept; fix the task and import "
                               f"again ({error})") from None
    _echo(f"created {folder}; validate with: agentrl env validate {folder}")


@import_app.command("swebench")
def import_swebench(
    source: Path = typer.Argument(..., help="SWE-bench rows: a .jsonl/.json file, or a folder written by datasets' "
                                            "save_to_disk."),
    out: Path | None = typer.Option(None, help="Package folder to write (default: ./<name>)."),
    name: str | None = typer.Option(None, help="Environment name (default: swebench-<file or folder name>)."),
    namespace: str | None = typer.Option(None, help="Image namespace for rows without an image (default: "
                                                       "swebench; '' names local builds sweb.eval.x86_64.<id>)."),
    split: str | None = typer.Option(None, help="Only this split of a saved DatasetDict."),
) -> None:
    """Turn SWE-bench rows into an agentrl package graded as SWE-bench grades them."""
    from agentrl.hub.interop.swebench import import_swebench_rows

    folder = import_swebench_rows(source, out=out, name=name, namespace=namespace, split=split)
    _echo(f"created {folder}; validate with: agentrl env validate {folder}")


@app.command("swebench-image")
def swebench_image(
    source: Path = typer.Argument(..., help="SWE-bench rows (.jsonl or a save_to_disk folder), or the package "
                                            "`agentrl env import swebench` wrote."),
    instance: list[str] | None = typer.Option(None, help="Only this row's image (repeatable; default: every row)."),
    task_repo: str | None = typer.Option(None, help="Build swebench's own Dockerfile of the row from this task "
                                                       "repo (a folder, or GitHub owner/repo)."),
    git_source: str | None = typer.Option(None, "--source", help="Build from the row: clone the project from this "
                                                                     "git URL or local mirror at its base_commit."),
    env_image: str | None = typer.Option(None, help="With --source: the image holding the project's environment."),
    network: bool = typer.Option(False, help="With --task-repo: let the build use the network."),
    namespace: str | None = typer.Option(None, help="Image namespace for rows without an image (as at import)."),
) -> None:
    """Pull SWE-bench rows' images, or build them from the rows (swebench's task repo, or git source + env image)."""
    from agentrl.hub.interop.swebench_images import get_swebench_images

    images = get_swebench_images(source, instances=instance, task_repo=task_repo, git_source=git_source,
                                 env_image=env_image, network=network, namespace=namespace, log=_echo)
    _echo(f"{len(images)} image(s) ready")


@import_app.command("verifiers")
def import_verifiers(
    path: Path = typer.Argument(..., help="verifiers package folder (a pyproject.toml naming verifiers)."),
    out: Path | None = typer.Option(None, help="Package folder to write (default: ./<project name>)."),
    name: str | None = typer.Option(None, help="Environment name (default: the project name)."),
) -> None:
    """Turn a verifiers environment package (v1 Taskset or load_environment()) into an agentrl package."""
    from agentrl.hub.interop.verifiers import import_verifiers_package

    folder = import_verifiers_package(path, out=out, name=name)
    _echo(f"created {folder}; install its requirements with: agentrl env install {folder}")
