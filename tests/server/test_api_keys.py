"""`--api-key`, alone and beside a tenants file, on live servers over the engine double (the
check sits in front of the engine, so the double's cheap start is enough)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from hipfire_serve.config import EngineConfig
from hipfire_serve.server.config import ServerConfig
from hipfire_serve.server.tenants import Tenant, hash_key, with_api_keys
from tests.server.conftest import RunningServer
from tests.server.engine_double import EngineDouble

FILE_KEY = "sk-file-tenant"
TENANTS = (Tenant(name="offonly", api_key_sha256=(hash_key(FILE_KEY),), speculation=("off",)),)


def _start(tenants: tuple[Tenant, ...] | None, api_key: tuple[str, ...]) -> RunningServer:
    config = ServerConfig(port=0, log_level="warning", api_key=api_key)
    return RunningServer(EngineDouble(), EngineConfig(model="double"), config, tenants).start()


@pytest.fixture(scope="module")
def keyed() -> Iterator[RunningServer]:
    running = _start(None, ("sk-one", "sk-two"))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def keyed_with_tenants() -> Iterator[RunningServer]:
    running = _start(TENANTS, ("sk-ops",))
    yield running
    running.stop()


def _get(server: RunningServer, path: str, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(server.url + path, headers=headers, timeout=30)


def test_every_key_opens_v1_and_the_tokenizer_routes(keyed):
    for key in ("sk-one", "sk-two"):
        client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=key, max_retries=0)
        assert client.models.list().data[0].id == "double"
        r = client.completions.create(model="double", prompt="ab", max_tokens=2)
        assert r.choices[0].text
        body = {"prompt": "ab"}
        headers = {"Authorization": f"Bearer {key}"}
        tokenized = httpx.post(keyed.url + "/tokenize", json=body, headers=headers, timeout=30)
        assert tokenized.status_code == 200 and tokenized.json()["count"] == 2


@pytest.mark.parametrize("key", ["sk-three", "sk-one-and-more", "SK-ONE"])
def test_wrong_key_is_401_in_openai_shape(keyed, key):
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        client.models.list()
    assert exc.value.body["code"] == "invalid_api_key"


def test_missing_key_is_401_on_every_keyed_route(keyed):
    responses = [
        _get(keyed, "/v1/models"),
        _get(keyed, "/v1/models/double"),
        httpx.post(keyed.url + "/v1/completions", json={"prompt": "x"}, timeout=30),
        httpx.post(keyed.url + "/tokenize", json={"prompt": "x"}, timeout=30),
        httpx.post(keyed.url + "/detokenize", json={"tokens": [5]}, timeout=30),
    ]
    for response in responses:
        assert response.status_code == 401, response.request.url
        assert response.json()["error"]["code"] == "invalid_api_key"
    basic = httpx.get(keyed.url + "/v1/models", headers={"Authorization": "Basic sk-one"})
    assert basic.status_code == 401


def test_health_metrics_and_version_stay_open(keyed):
    for path in ("/health", "/metrics", "/version"):
        assert _get(keyed, path).status_code == 200, path


def test_keys_beside_tenants_are_the_default_tenant(keyed_with_tenants):
    def complete(key: str, speculation: str) -> httpx.Response:
        body = {"prompt": "ab", "max_tokens": 2, "speculation": speculation}
        headers = {"Authorization": f"Bearer {key}"}
        url = keyed_with_tenants.url + "/v1/completions"
        return httpx.post(url, json=body, headers=headers, timeout=30)

    # the file's tenant keeps its own rules, the --api-key key is a tenant without limits
    assert complete(FILE_KEY, "off").status_code == 200
    assert complete(FILE_KEY, "on").status_code == 400
    assert complete("sk-ops", "on").status_code == 200
    assert complete("sk-unknown", "off").status_code == 401


def test_with_api_keys_joins_a_default_tenant_and_refuses_shared_keys():
    assert with_api_keys(None, ()) is None
    only = with_api_keys(None, ("k",))
    assert only == [Tenant(name="default", api_key_sha256=(hash_key("k"),))]
    limited = Tenant(name="default", api_key_sha256=(hash_key("a"),), requests_per_minute=5)
    joined = with_api_keys([limited], ("k", "k"))
    assert joined == [
        Tenant(
            name="default",
            api_key_sha256=(hash_key("a"), hash_key("k")),
            requests_per_minute=5,
        )
    ]
    with pytest.raises(ValueError, match="offonly"):
        with_api_keys(list(TENANTS), (FILE_KEY,))
