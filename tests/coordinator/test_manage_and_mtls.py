"""The management listener (loopback by default; elsewhere only behind ``manage_api_keys``, which
then gate every route with 401) and mutual TLS on the predict port (``tls_config.ca_cert``: a client
must present a certificate the CA signed). A real Coordinator's apps, without Ray."""

from __future__ import annotations

import ssl
from typing import Any

import httpx
import pytest
import trustme

from coordinator.cli import main
from coordinator.config.loader import check_manage_listener, defaults
from coordinator.server import Coordinator, tls_options
from engine.errors import ConfigError
from tests.support.coordinator_configs import (
    KEY,
    client_context,
    config_with,
    get,
    https_server,
)


@pytest.fixture(scope="module")
def coordinator() -> Coordinator:
    return Coordinator(config_with(manage_ip="10.1.2.3", manage_api_keys=[KEY]))


def test_manage_listens_on_loopback_by_default():
    assert defaults()["http_config"]["manage_ip"] == "127.0.0.1"
    check_manage_listener(defaults())  # no keys needed there


@pytest.mark.parametrize("ip", ["0.0.0.0", "10.1.2.3", "::"])
def test_manage_off_loopback_without_keys_is_a_config_error(ip):
    config = config_with(manage_ip=ip, allow_all_zero_ip_listening=True)
    with pytest.raises(ConfigError, match=r"http_config\.manage_ip .*http_config\.manage_api_keys"):
        check_manage_listener(config)
    check_manage_listener(config.with_overrides({"http_config.manage_api_keys": [KEY]}))


def test_pdserve_refuses_to_start_with_an_unprotected_manage_port(capsys, monkeypatch):
    monkeypatch.delenv("MINDIE_MS_COORDINATOR_CONFIG_FILE_PATH", raising=False)
    assert main(["--manage-ip", "10.1.2.3"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("pdserve: configuration error: http_config.manage_ip 10.1.2.3")


def test_the_coordinator_refuses_to_listen_unprotected():
    unprotected = Coordinator(config_with(manage_ip="10.1.2.3"))
    with pytest.raises(ConfigError, match="manage_api_keys"):
        unprotected.uvicorn_configs()


@pytest.mark.parametrize(
    "headers",
    [{}, {"api-key": "wrong"}, {"authorization": "Bearer wrong"}],
    ids=["none", "wrong api-key", "wrong bearer"],
)
def test_manage_routes_need_a_manage_key(coordinator, headers):
    response = get(coordinator.manage_app(), "/v1/instances", **headers)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "Unauthorized"


@pytest.mark.parametrize("header", [("api-key", KEY), ("authorization", f"Bearer {KEY}")])
def test_a_manage_key_opens_the_manage_routes(coordinator, header):
    response = get(coordinator.manage_app(), "/v1/instances", **dict([header]))
    assert response.status_code == 200
    assert response.json()["ready"] is False


def test_predict_keys_do_not_open_the_manage_port():
    config = config_with(manage_api_keys=[KEY]).with_overrides(
        {"http_config.api_keys": ["predict-key"]}
    )
    app = Coordinator(config).manage_app()
    assert get(app, "/v1/instances", **{"api-key": "predict-key"}).status_code == 401


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> tuple[trustme.CA, dict[str, Any]]:
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    where = tmp_path_factory.mktemp("pki")
    server.private_key_pem.write_to_path(where / "key.pem")
    server.cert_chain_pems[0].write_to_path(where / "cert.pem")
    ca.cert_pem.write_to_path(where / "ca.pem")
    tls = {
        "request_server_tls_enable": True,
        "tls_cert": str(where / "cert.pem"),
        "tls_key": str(where / "key.pem"),
        "ca_cert": str(where / "ca.pem"),
    }
    return ca, tls


def test_ca_cert_requires_client_certificates(pki):
    _, tls = pki
    assert tls_options(tls)["ssl_cert_reqs"] == ssl.CERT_REQUIRED
    assert "ssl_cert_reqs" not in tls_options({**tls, "ca_cert": ""})
    assert tls_options({**tls, "request_server_tls_enable": False}) == {}


def test_a_client_certificate_signed_by_the_ca_is_let_in(pki):
    ca, tls = pki
    with (
        https_server(tls_options(tls)) as port,
        httpx.Client(verify=client_context(ca, with_cert=True)) as client,
    ):
        response = client.get(f"https://127.0.0.1:{port}/ping")
    assert response.status_code == 200 and response.json() == {"pong": "yes"}


def test_a_client_without_a_certificate_fails_the_handshake(pki):
    ca, tls = pki
    with (
        https_server(tls_options(tls)) as port,
        httpx.Client(verify=client_context(ca, with_cert=False)) as client,
        pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)),
    ):
        client.get(f"https://127.0.0.1:{port}/ping")


def test_a_certificate_from_another_ca_fails_the_handshake(pki):
    ca, tls = pki
    other = trustme.CA()
    context = ssl.create_default_context()
    ca.configure_trust(context)
    other.issue_cert("client@elsewhere").configure_cert(context)
    with (
        https_server(tls_options(tls)) as port,
        httpx.Client(verify=context) as client,
        pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)),
    ):
        client.get(f"https://127.0.0.1:{port}/ping")
