"""Live servers on loopback for the server tests.

`RunningServer` runs the real uvicorn server (uvloop, httptools) in a background thread with its
own event loop, on an ephemeral port. The real engine runs on a tiny random Llama checkpoint
(CPU); engines are built once per session because loading costs seconds on 2 cores.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hipfire_serve.config import EngineConfig
from hipfire_serve.server.config import ServerConfig
from hipfire_serve.server.main import build_server
from hipfire_serve.server.tenants import Tenant, hash_key

# Two tenants for the auth / rate-limit / metrics tests.
ACME_KEY = "sk-acme-test-key"
SLOW_KEY = "sk-slow-test-key"
TENANTS = (
    Tenant(name="acme", api_key_sha256=(hash_key(ACME_KEY),), weight=2.0),
    Tenant(
        name="slow",
        api_key_sha256=(hash_key(SLOW_KEY),),
        requests_per_minute=2,
        tokens_per_minute=400,
        speculation=("off",),
    ),
)


class RunningServer:
    def __init__(
        self,
        engine: Any,
        engine_config: EngineConfig,
        server_config: ServerConfig,
        tenants: tuple[Tenant, ...] | None = None,
    ) -> None:
        self.engine = engine
        self.built = build_server(engine, engine_config, server_config, tenants)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import uvloop

        self.loop = uvloop.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.built.server.serve())

    def start(self) -> RunningServer:
        self._thread.start()
        deadline = time.monotonic() + 60
        while self.built.server.port is None:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.built.server.port}"

    def call(self, fn: Callable[[Any], Any]) -> Any:
        """Runs fn(engine) in the engine thread between rounds."""
        future = asyncio.run_coroutine_threadsafe(self.built.engine.call(fn), self.loop)
        return future.result(timeout=30)

    def stats(self) -> Any:
        future = asyncio.run_coroutine_threadsafe(self.built.engine.stats(), self.loop)
        return future.result(timeout=30)

    def wait_idle(self, timeout_s: float = 20.0) -> Any:
        """Engine stats once no slot, queue entry or KV block is held (or the last seen)."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            idle = stats.live_slots == 0 and stats.num_waiting == 0 and stats.kv_usage == 0
            if idle and getattr(stats, "num_free_kv_blocks", 0) == stats.num_kv_blocks:
                return stats
            if time.monotonic() > deadline:
                return stats
            time.sleep(0.05)

    def stop(self) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(setattr, self.built.server, "should_exit", True)
        self._thread.join(timeout=30)


def _tiny_engine_config(model_dir: Path, **overrides: Any) -> EngineConfig:
    settings = dict(
        model=str(model_dir),
        draft="ngram",
        spec_mode="adaptive",
        spec_depth=4,
        device="cpu",
        dtype="float32",
        kv_cache_memory="8MiB",
        max_concurrency=8,
        max_queue=64,
        max_model_len=256,
        graphs="off",
        cost_profile="auto",
    )
    settings.update(overrides)
    return EngineConfig(**settings)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from tests.fixtures.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("server-model") / "tiny-llama", arch="llama")


def start_real_server(
    model_dir: Path,
    *,
    tenants: tuple[Tenant, ...] | None = None,
    engine_overrides: dict | None = None,
    **server_settings: Any,
) -> RunningServer:
    engine_config = _tiny_engine_config(model_dir, **(engine_overrides or {}))
    specs = [t.to_spec() for t in tenants] if tenants else ()
    if server_settings.get("engine_loop") == "process":
        from hipfire_serve.server.engine_process import ProcessEngine

        engine = ProcessEngine(engine_config, specs)
    else:
        from hipfire_serve.engine import Engine

        engine = Engine(engine_config, tenants=specs)
    server_config = ServerConfig(port=0, log_level="warning", **server_settings)
    return RunningServer(engine, engine_config, server_config, tenants).start()


@pytest.fixture(scope="session")
def server(tiny_model_dir) -> Iterator[RunningServer]:
    """The shared open-access server on the real engine (vLLM-compatible metric names on)."""
    running = start_real_server(tiny_model_dir, metrics_compat="vllm")
    yield running
    running.stop()


@pytest.fixture(scope="session")
def tenant_server(tiny_model_dir) -> Iterator[RunningServer]:
    running = start_real_server(tiny_model_dir, tenants=TENANTS, metrics_tenant_labels=True)
    yield running
    running.stop()


@pytest.fixture
def double_server() -> Iterator[Callable[..., RunningServer]]:
    """Factory: a server on the engine double (per test, torn down after)."""
    from tests.server.engine_double import EngineDouble

    started: list[RunningServer] = []

    def make(**settings: Any) -> RunningServer:
        engine_kwargs = {
            k: settings.pop(k)
            for k in ("max_concurrency", "max_queue", "max_model_len", "round_s")
            if k in settings
        }
        engine = EngineDouble(**engine_kwargs)
        config = ServerConfig(port=0, log_level="warning", **settings)
        running = RunningServer(engine, EngineConfig(model="double"), config).start()
        started.append(running)
        return running

    yield make
    for running in started:
        running.stop()
