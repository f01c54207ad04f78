"""The Ray Serve ingress app (``coordinator/serve_app.py``) on a real socket, without Ray:
``/metrics`` stays off Serve's public port unless ``metrics=on``, then behind the API keys; a
config asking the app for HTTPS, which Serve's proxy terminates, is refused at start."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from coordinator.serve_app import CoordinatorIngress, build, ingress_app, serve_config
from coordinator.server import Coordinator
from engine.errors import ConfigError

KEY = "scrape-secret"


def config_file(tmp_path: Path, **sections: dict[str, Any]) -> str:
    values = {"backend_config": {"embedding_model_path": ""}, **sections}
    path = tmp_path / "ms_coordinator.json"
    path.write_text(json.dumps(values))
    return str(path)


@contextlib.contextmanager
def serving(args: dict[str, Any]) -> Iterator[str]:
    """The ingress app the replica builds from ``args``, on 127.0.0.1 (the cluster not started:
    ``ready`` is set by hand, so the predict app answers as it would once up)."""
    coordinator = Coordinator(serve_config(args))
    coordinator.ready = True
    app = ingress_app(coordinator, metrics=args.get("metrics") == "on")
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


def is_exposition(response: httpx.Response) -> bool:
    return response.status_code == 200 and "# HELP" in response.text


def test_metrics_are_not_on_the_public_port_by_default(tmp_path):
    with serving({"config": config_file(tmp_path)}) as url:
        response = httpx.get(f"{url}/metrics", timeout=10)
        assert response.status_code == 404 and "# HELP" not in response.text
        assert httpx.get(f"{url}/v1/readiness", timeout=10).status_code == 200  # probes stay


def test_metrics_on_are_behind_the_api_keys(tmp_path):
    config = config_file(tmp_path, http_config={"api_keys": [KEY]})
    with serving({"config": config, "metrics": "on"}) as url:
        assert httpx.get(f"{url}/metrics", timeout=10).status_code == 401
        wrong = httpx.get(f"{url}/metrics", headers={"api-key": "nope"}, timeout=10)
        assert wrong.status_code == 401 and "# HELP" not in wrong.text
        bearer = {"Authorization": f"Bearer {KEY}"}
        assert is_exposition(httpx.get(f"{url}/metrics", headers=bearer, timeout=10))
        assert is_exposition(httpx.get(f"{url}/metrics", headers={"api-key": KEY}, timeout=10))


def test_metrics_on_without_keys_are_open(tmp_path):
    with serving({"config": config_file(tmp_path), "metrics": "on"}) as url:
        assert is_exposition(httpx.get(f"{url}/metrics", timeout=10))


def test_https_of_the_app_is_refused_in_serve_mode(tmp_path):
    tls = {"request_server_tls_enable": True, "tls_cert": "/c.pem", "tls_key": "/k.pem"}
    args = {"config": config_file(tmp_path, tls_config=tls)}
    with pytest.raises(ConfigError, match=r"request_server_tls_enable .*http_options"):
        serve_config(args)
    # The same file with TLS off is accepted.
    tls["request_server_tls_enable"] = False
    assert serve_config({"config": config_file(tmp_path, tls_config=tls)})


def test_the_replica_refuses_the_tls_config_at_start(tmp_path):
    """What Serve runs when it starts a replica: the deployment's own constructor (under the
    wrapper ``serve.ingress`` puts around it)."""
    wrapper = CoordinatorIngress.func_or_class  # type: ignore[attr-defined]
    (replica,) = [c for c in wrapper.__mro__[1:] if "__serve_build_asgi_app__" in c.__dict__]
    tls = {"request_server_tls_enable": True, "tls_cert": "/c.pem", "tls_key": "/k.pem"}
    with pytest.raises(ConfigError, match="request_server_tls_enable"):
        replica.__init__(object.__new__(replica), {"config": config_file(tmp_path, tls_config=tls)})


def test_metrics_argument_is_checked_at_build(tmp_path):
    with pytest.raises(ConfigError, match="metrics must be one of"):
        build({"config": config_file(tmp_path), "metrics": "public"})


def test_replicas_share_one_named_pool(tmp_path):
    """``replicas=N`` runs N ingress replicas, each a coordinator over one shared pool: more than
    one needs a cluster_name, from the arguments or the config file."""
    config = config_file(tmp_path)
    assert build({"config": config})._bound_deployment.num_replicas == 1
    named = build({"config": config, "replicas": "3", "cluster_name": "prod"})
    assert named._bound_deployment.num_replicas == 3
    assert (
        serve_config({"config": config, "cluster_name": "prod"})["backend_config"]["cluster_name"]
        == "prod"
    )
    with pytest.raises(ConfigError, match="replicas=2 needs cluster_name"):
        build({"config": config, "replicas": "2"})
    in_file = tmp_path / "named"
    in_file.mkdir()
    pool = {"embedding_model_path": "", "cluster_name": "pool"}
    path = in_file / "ms_coordinator.json"
    path.write_text(json.dumps({"backend_config": pool}))
    assert build({"config": str(path), "replicas": 2})._bound_deployment.num_replicas == 2
    for bad in ("0", "two", "65"):
        with pytest.raises(
            ConfigError, match=f"replicas must be an integer in \\[1, 64\\], got '{bad}'"
        ):
            build({"config": config, "replicas": bad})
