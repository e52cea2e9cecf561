"""quiver-serve daemon: ``quiver-serve`` (or ``python server.py`` in a checkout, or ``python -m
quiver_serve``) serves the embedded default, Cora + GraphSAGE shipped inside the package.

``--config X.yaml`` serves anything else (its relative paths are taken from its own folder);
``--host`` / ``--port`` override the config.
SIGINT/SIGTERM: stop admitting, finish in-flight work (``server.drain_timeout_s``), stop every process.
``server.http_workers`` > 1 runs that many HTTP front-end processes on the port (SO_REUSEPORT),
supervised by this process (``quiver_serve/frontend/frontdoor.py``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from quiver_serve.config import ConfigError, ServeConfig
from quiver_serve.paths import DEFAULT_CONFIG_PATH, shown_path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None,
                   help="YAML config (default: $QUIVER_SERVE_CONFIG, else the embedded default, "
                        f"{shown_path(DEFAULT_CONFIG_PATH)}); "
                        "QUIVER_SERVE__<SECTION>__<KEY>=<value> variables override single fields")
    p.add_argument("--host", help="bind address (default from config: 127.0.0.1)")
    p.add_argument("--port", type=int, help="TCP port (default from config: 8000)")
    p.add_argument("--http-workers", type=int,
                   help="HTTP front-end processes on the port (default from config: 0 = by CPUs)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s")
    try:
        cfg = ServeConfig.load(args.config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.setswitchinterval(cfg.inference.switch_interval_ms / 1e3)  # decision 0058
    if args.host:
        cfg.server.host = args.host
    if args.port is not None:
        cfg.server.port = args.port
    if args.http_workers is not None:
        try:
            cfg.server.http_workers = args.http_workers
        except ValueError as exc:
            print(f"error: --http-workers: {exc}", file=sys.stderr)
            return 2

    busy = port_in_use(cfg)
    if busy:
        print(f"quiver-serve: {busy}", file=sys.stderr, flush=True)
        return 1

    from quiver_serve.config import resolve_http_workers

    workers = resolve_http_workers(cfg.server.http_workers)
    from quiver_serve.engine.procs.bytecode import COMPILE_ENV, keep_bytecode

    pycache = keep_bytecode()  # before the first child is spawned (decision 0067)
    if pycache:
        logging.getLogger(__name__).info(
            "no compiled bytecode beside torch's sources and none written there: the daemon's "
            "processes keep theirs in %s%s", shown_path(pycache),
            " (compiled beside the start: writing bytecode is off)"
            if os.environ.get(COMPILE_ENV) else "")
    if cfg.server.spawn_early:  # before this process imports torch, maps the graph, ...
        from quiver_serve.engine.procs.standby import prime_daemon

        prime_daemon(cfg)
    if workers > 1:
        from quiver_serve.frontend import frontdoor

        return frontdoor.run(cfg, workers, args.log_level)
    return serve_in_process(cfg, args.log_level)


def port_in_use(cfg: ServeConfig) -> str | None:
    """Why the daemon cannot listen (a port held by another process), checked before anything
    starts, so the daemon ends at once with one line instead of after loading the graph."""
    from quiver_serve.frontend.listen import check_port_free

    for name in ("port", "grpc_port"):
        port = getattr(cfg.server, name)
        if not port:  # None (no gRPC) or 0 (any free port)
            continue
        try:
            check_port_free(cfg.server.host, port)
        except OSError as exc:
            return f"cannot listen on {cfg.server.host}:{port} (server.{name}): {exc.strerror or exc}"
    return None


def serve_in_process(cfg: ServeConfig, log_level: str) -> int:
    """One front-end, in this process beside the supervisor (the cheapest path)."""
    import uvicorn

    from quiver_serve.engine.procs.bytecode import compile_later
    from quiver_serve.engine.procs.heap import start_gc_watch
    from quiver_serve.engine.procs.supervisor import StartFailed
    from quiver_serve.frontend.app import create_app
    from quiver_serve.frontend.listen import DrainingServer, uvicorn_options

    app = create_app(cfg)
    compile_later("main")  # decision 0067: a no-op unless bytecode is kept aside
    state = app.state.qs
    server = DrainingServer(uvicorn.Config(
        app, host=cfg.server.host, port=cfg.server.port, log_level=log_level,
        timeout_graceful_shutdown=max(int(cfg.server.drain_timeout_s), 1), access_log=False,
        **uvicorn_options(app)), state.pipeline, cfg.server.drain_timeout_s)

    gave_up: list[str] = []  # the line of a child that kept dying before it became ready

    def fatal(exc: BaseException) -> None:
        if isinstance(exc, StartFailed):
            gave_up.append(str(exc))
        else:
            logging.getLogger("quiver_serve").error("start-up failed, exiting: %s", exc)
        server.should_exit = True

    def child_gave_up(line: str) -> None:  # from the supervisor's watch thread, after start-up
        gave_up.append(line)
        server.should_exit = True

    def started() -> Any:
        state.pipeline.supervisor.on_fatal = child_gave_up
        return start_gc_watch("main", cfg.server.gc_freeze).flush

    state.on_fatal = fatal
    state.on_started = started
    server.run()
    if gave_up:
        print(gave_up[0], file=sys.stderr, flush=True)  # the daemon's last word: one line
        return 1
    return 1 if state.start_error is not None else 0
