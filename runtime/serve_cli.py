"""`mg-serve`: load an artifact once, start the engine thread, serve the OpenAI API over HTTP.

Bad flags and artifacts that cannot be served are one line and exit 2, before
anything listens. SIGTERM / SIGINT: stop accepting, let in-flight requests end
(up to --shutdown-timeout seconds; one second before it runs out, those still
running are cut, each ending with a final chunk), exit 0.
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
from pathlib import Path

import click

from .cli import check_device, engine_config, engine_options, engine_setup


def _die(msg: str) -> None:
    click.echo(f"mg-serve: error: {msg}", err=True)
    sys.exit(2)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mg-toolchain", prog_name="mg-serve")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--max-queue", type=int, default=64, show_default=True,
              help="Requests that may wait for a sequence slot; beyond it new requests get 429 at once.")
@click.option("--api-key", default=None, envvar="MG_SERVE_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1/* (also from $MG_SERVE_API_KEY) [default: none].")
@click.option("--max-tokens", "default_max_tokens", type=int, default=256, show_default=True,
              help="Tokens generated when a request sets no max_tokens (capped by the context).")
@click.option("--shutdown-timeout", type=float, default=30.0, show_default=True,
              help="Seconds in-flight requests get to finish after SIGTERM before they are cut.")
@engine_options
def main(artifact, host, port, max_queue, api_key, default_max_tokens, shutdown_timeout, device, threads, kv_layout,
         no_dflash, draft_block, speculation, compile_methods, no_cuda_graphs, fused_rounds, overlap,
         int4_tensor_cores, row_invariant, rows_kernel, no_verify):
    """Serve ARTIFACT (an mg-export directory) with an OpenAI-compatible HTTP API."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError as e:
        _die(f"mg-serve needs fastapi, uvicorn and prometheus-client ({e.name} is missing): "
             f"pip install 'mg-toolchain[serve]'")
    if not 1 <= port <= 65535:
        _die(f"--port is {port}; allowed: 1 .. 65535")
    if max_queue < 0:
        _die(f"--max-queue is {max_queue}; allowed: an integer >= 0")
    if default_max_tokens < 1:
        _die(f"--max-tokens is {default_max_tokens}; allowed: an integer >= 1")
    check_device(device, _die)
    _check_port(host, port)
    engine_setup(device, threads, _die, spare_core=True)  # a core for the HTTP loop (BENCHMARKS.md, Serving)
    import torch

    from .artifact import ArtifactError, load_artifact
    from .engine import Engine
    from .http_server import EngineWorker, Metrics, ServerState, create_app, load_chat_template
    from .speculative import DFlashError
    from .tokenizer import TextCodec

    try:
        art = load_artifact(artifact, device=device, layout=kv_layout, verify=not no_verify)
        config = engine_config(device, no_dflash, draft_block, speculation, compile_methods, no_cuda_graphs,
                               fused_rounds, overlap, int4_tensor_cores, row_invariant, rows_kernel)
        engine = Engine(art, config)
        codec = TextCodec(art.tokenizer_path, art.manifest.model.bos_id) if art.tokenizer_path else None
    except (ArtifactError, DFlashError, ValueError) as e:
        _die(str(e))
    engine.warm_up()
    metrics = Metrics()
    worker = EngineWorker(engine, metrics)
    worker.start()
    m = art.manifest
    state = ServerState(worker=worker, codec=codec, model=m.model.name, capacity=m.kv.capacity,
                        check=engine.scheduler.check, max_queue=max_queue, n_slots=engine.cache.n_slots,
                        api_key=api_key, metrics=metrics, chat_template=load_chat_template(artifact),
                        default_max_tokens=default_max_tokens)
    server = _server(uvicorn.Config(create_app(state), host=host, port=port, log_level="warning",
                                    timeout_graceful_shutdown=shutdown_timeout, lifespan="off"))
    click.echo(f"mg-serve: {m.model.name} ({m.kv.layout} layout, {engine.cache.n_slots} sequences, "
               f"{'DFlash ' + config.speculation if engine.spec is not None else 'target only'}, {device}"
               f"{f', {torch.get_num_threads()} threads' if device == 'cpu' else ''}) on "
               f"http://{host}:{port}/v1", err=True)
    def shut_down(*_) -> None:
        """Stop accepting; requests still running a second before the grace period ends are cut by stopping the
        engine thread, which ends each of them with a final chunk (finish_reason "length")."""
        if not server.should_exit:
            server.should_exit = True
            cut = threading.Timer(max(0.0, shutdown_timeout - 1.0), worker.stop)
            cut.daemon = True
            cut.start()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, shut_down)
    try:
        server.run()
    finally:
        worker.stop()
        worker.join(timeout=10)
    click.echo("mg-serve: stopped", err=True)


def _server(config):
    """uvicorn's server without its own signal handling (it re-raises a caught SIGTERM after shutting down,
    which would end the process with -15 rather than 0); `main` installs ours."""
    import contextlib

    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    return Server(config)


def _check_port(host: str, port: int) -> None:
    """Refuse up front (one line) an address that cannot be bound, before the model is loaded."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        _die(f"cannot listen on {host}:{port} ({e.strerror or e})")


if __name__ == "__main__":
    main()
