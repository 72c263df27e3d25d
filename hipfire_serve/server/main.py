"""`hipfire-serve serve`: configuration -> engine -> HTTP server on uvicorn (uvloop, httptools).

Shutdown: the first SIGTERM/SIGINT starts a drain (new requests get 503, in-flight ones run up
to --drain-timeout, then the rest are aborted), after which the process exits 0. A second signal
ends the process at once with 128 + its number (130 for SIGINT, 143 for SIGTERM), the engine
child killed first. An engine the supervisor cannot restart ends it with status 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import uvicorn

from hipfire_serve.config import EngineConfig
from hipfire_serve.server.app import App
from hipfire_serve.server.async_engine import AsyncEngine
from hipfire_serve.server.config import ServerConfig, resolve
from hipfire_serve.server.engine_client import EngineClient
from hipfire_serve.server.http import JsonErrorHttpToolsProtocol, redact_access_log
from hipfire_serve.server.metrics import ServerMetrics
from hipfire_serve.server.model_overrides import (
    generation_defaults,
    load_chat_template,
    model_dir,
)
from hipfire_serve.server.supervisor import EngineSupervisor
from hipfire_serve.server.tenants import Tenant, TenantRegistry, load_tenants, with_api_keys
from hipfire_serve.server.tool_choice import resolve_tool_calling

logger = logging.getLogger("hipfire_serve.server")


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose exit signals drain the app first instead of dropping requests."""

    def __init__(self, config: uvicorn.Config, app: App, startup_line: str) -> None:
        super().__init__(config)
        self.app = app
        self.startup_line = startup_line
        self.port: int | None = None
        self.started_event = asyncio.Event()
        self.exit_status = 0
        self._drain_started = False
        self._num_signals = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.servers and self.servers[0].sockets:
            self.port = self.servers[0].sockets[0].getsockname()[1]
        if self.started:
            print(self.startup_line.format(port=self.port), flush=True)
            self.started_event.set()

    def handle_exit(self, sig: int, frame: Any) -> None:
        # Not recorded for re-raising (uvicorn's default), so a drained server exits 0.
        self._num_signals += 1
        name = signal.Signals(sig).name
        if self._num_signals > 1:
            logger.warning("received %s again: exiting now", name)
            self.app.engine.kill()
            exit_at_once(128 + sig)
        if self._loop is None:
            self.should_exit = True
            return
        logger.info("received %s: draining", name)
        self._loop.call_soon_threadsafe(self.begin_drain)

    def on_engine_fatal(self, fault: str) -> None:
        """The supervisor gave up on the engine: exit (status 1) once the replies are out."""
        self.exit_status = 1
        self.should_exit = True

    def begin_drain(self) -> None:
        """Drain, then exit the serve loop (event-loop thread)."""
        if self._drain_started:
            return
        self._drain_started = True

        def exit_now() -> None:
            self.should_exit = True

        deadline_s = self.app.config.drain_timeout
        self._drain_task = asyncio.ensure_future(self.app.drain(deadline_s, exit_now))


@dataclass
class Built:
    server: DrainingServer
    app: App
    engine: EngineClient


def build_server(
    engine: Any,
    engine_config: EngineConfig,
    server_config: ServerConfig,
    tenants: Sequence[Tenant] | None,
) -> Built:
    """Wires an engine into the app and a uvicorn server (not started). `engine` is an `Engine`
    (driven from a thread) or a `ProcessEngine` (already running in its child process).
    `tenants=None` and no `--api-key`: open access. ValueError on a bad `--chat-template`,
    `--generation-config`, key or tool-calling flags."""
    model_name = server_config.served_model_name or engine.model_name
    file_tenants = tenants
    tenants = with_api_keys(tenants, server_config.api_key)
    tokenizer = engine.tokenizer
    template = load_chat_template(server_config.chat_template)
    if template is not None:
        # the server renders every chat; the engine never does, so its tokenizer stays as is
        tokenizer = tokenizer.with_chat_template(template)
    defaults = generation_defaults(server_config.generation_config, model_dir(engine_config))
    tool_calling = resolve_tool_calling(server_config, engine_config.model)
    if defaults:
        logger.info("default sampling parameters from the generation config: %s", defaults)
    metrics = ServerMetrics(
        model_name,
        vllm_compat=server_config.metrics_compat == "vllm",
        tenant_labels=server_config.metrics_tenant_labels,
    )
    registry = TenantRegistry.open_access() if tenants is None else TenantRegistry(tenants)
    engine_loop = engine if isinstance(engine, EngineClient) else AsyncEngine(engine)
    engine_loop.on_round = metrics.observe_engine
    app = App(
        engine_loop,
        tokenizer=tokenizer,
        model_name=model_name,
        max_model_len=engine.max_model_len,
        config=server_config,
        tenants=registry,
        metrics=metrics,
        num_slots=engine_config.max_concurrency,
        max_queue=engine_config.max_queue,
        generation_defaults=defaults,
        tool_calling=tool_calling,
    )
    uv_config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        http=JsonErrorHttpToolsProtocol,
        loop="uvloop",
        lifespan="on",
        log_level=server_config.log_level,
        access_log=server_config.log_level == "debug",
        timeout_graceful_shutdown=max(1.0, server_config.drain_timeout + 5.0),
        h11_max_incomplete_event_size=server_config.max_body_bytes,
    )
    redact_access_log()  # after uvicorn.Config, which configures logging
    num_keys = len(set(server_config.api_key))
    if file_tenants is not None:
        access = f"{len(file_tenants)} tenant(s) from {server_config.tenants or 'the caller'}"
        access += f" and {num_keys} --api-key key(s) as tenant 'default'" if num_keys else ""
    elif num_keys:
        access = f"{num_keys} API key(s) (--api-key)"
    else:
        access = "open access (no --tenants file or --api-key: any API key is accepted)"
    host = server_config.host
    url_host = f"[{host}]" if ":" in host else host
    line = (
        f"hipfire-serve: serving {model_name!r} (model {engine_config.model}, draft "
        f"{engine_config.draft}, spec mode {engine_config.spec_mode}, "
        f"{engine_config.max_concurrency} slots, context {engine.max_model_len}, engine in a "
        f"{server_config.engine_loop}) at "
        f"http://{url_host}:{{port}}/v1 with {access}"
    )
    server = DrainingServer(uv_config, app, line)
    app.supervisor = EngineSupervisor(
        engine_loop,
        stall_timeout_s=server_config.engine_stall_timeout,
        max_restarts=server_config.engine_restarts,
        is_draining=lambda: app.draining,
    )
    app.supervisor.on_fatal = server.on_engine_fatal
    return Built(server=server, app=app, engine=engine_loop)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        engine_config, server_config = resolve(argv)
        tenants = load_tenants(server_config.tenants) if server_config.tenants else None
        # checked before the model loads, so that a typo costs no start-up
        with_api_keys(tenants, server_config.api_key)
        load_chat_template(server_config.chat_template)
        generation_defaults(server_config.generation_config, model_dir(engine_config))
        resolve_tool_calling(server_config, engine_config.model)
    except ValueError as exc:
        print(f"hipfire-serve serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=server_config.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s"
    )
    try:
        specs = [t.to_spec() for t in tenants] if tenants else ()
        if server_config.engine_loop == "process":
            from hipfire_serve.server.engine_process import ProcessEngine

            engine = ProcessEngine(engine_config, specs)
        else:
            from hipfire_serve.engine import Engine

            engine = Engine(engine_config, tenants=specs)
    except (ValueError, OSError, RuntimeError) as exc:  # RuntimeError: warm-up, device OOM
        print(f"hipfire-serve serve: {exc}", file=sys.stderr)
        return 2
    built = build_server(engine, engine_config, server_config, tenants)
    import uvloop

    uvloop.run(built.server.serve())
    if built.server.exit_status:
        # A stalled engine thread may still be inside a round: the interpreter's teardown
        # would wait on it or destroy the native threads under it.
        exit_at_once(built.server.exit_status)
    return 0


def exit_at_once(status: int) -> None:
    """Ends the process now, skipping the interpreter's teardown (which would join or destroy
    an engine thread in the middle of a round: a hang or an abort)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
