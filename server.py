#!/usr/bin/env python
"""quiver-serve daemon: ``python server.py`` serves the embedded default (Cora + GraphSAGE).

``--config configs/X.yaml`` serves anything else; ``--host`` / ``--port`` override the config.
SIGINT/SIGTERM: stop admitting, finish in-flight work (``server.drain_timeout_s``), stop every process.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading

from quiver_serve.config import DEFAULT_CONFIG_PATH, ConfigError, ServeConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None,
                   help=f"YAML config (default: $QUIVER_SERVE_CONFIG, else {DEFAULT_CONFIG_PATH.name}); "
                        "QUIVER_SERVE__<SECTION>__<KEY>=<value> variables override single fields")
    p.add_argument("--host", help="bind address (default from config: 127.0.0.1)")
    p.add_argument("--port", type=int, help="TCP port (default from config: 8000)")
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
    if args.host:
        cfg.server.host = args.host
    if args.port is not None:
        cfg.server.port = args.port

    import uvicorn

    from quiver_serve.http.app import create_app

    app = create_app(cfg)
    state = app.state.qs

    class Server(uvicorn.Server):
        """First SIGTERM/SIGINT drains (readiness 503, in-flight work finishes), then exits 0."""

        draining = False

        def handle_exit(self, sig: int, frame: object) -> None:
            if self.draining:  # a second signal: stop now
                super().handle_exit(sig, frame)  # type: ignore[arg-type]
            else:
                self.draining = True
                logging.getLogger("quiver_serve").info(
                    "signal %d: draining (up to %.0f s)", sig, cfg.server.drain_timeout_s)
                threading.Thread(target=self._drain, name="quiver-drain", daemon=True).start()
            # uvicorn re-raises the signal after shutdown; a requested stop is a clean exit (0).
            self._captured_signals.clear()

        def _drain(self) -> None:
            state.pipeline.begin_drain()
            state.pipeline.wait_drained(cfg.server.drain_timeout_s)
            self.should_exit = True

    server = Server(uvicorn.Config(
        app, host=cfg.server.host, port=cfg.server.port, log_level=args.log_level,
        timeout_graceful_shutdown=max(int(cfg.server.drain_timeout_s), 1), access_log=False,
    ))

    def fatal(exc: BaseException) -> None:
        logging.getLogger("quiver_serve").error("start-up failed, exiting: %s", exc)
        server.should_exit = True

    state.on_fatal = fatal
    server.run()
    return 1 if state.start_error is not None else 0


if __name__ == "__main__":
    sys.exit(main())
