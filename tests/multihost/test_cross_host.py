"""pdserve across hosts (network namespaces, see conftest.py), over ZMQ and over gRPC: each role's
actor runs on its own host, greedy answers equal the engine's alone, the KV pages cross the
bridge (never through shared memory: the hosts' /dev/shm are their own) and the decode host's
interface sees them, and the KV endpoint, encrypted with peer authentication as the chart
configures it, answers nobody without the cluster's credentials."""

from __future__ import annotations

import re
import ssl

import grpc
import pytest
import zmq

from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.transfer.proto import kv_transfer_pb2 as pb
from engine.transfer.proto import kv_transfer_pb2_grpc as pb_grpc
from testbed.ray_hosts import HostedCoordinator, RayOnHosts
from tests.multihost.conftest import hosted

pytestmark = [pytest.mark.ray, pytest.mark.multihost]
PROMPTS = ("The quick brown fox", "def add(a, b):", "Once upon a time, far away")
NEW_TOKENS = 24
PATHS = {"zmq": "frames", "grpc": "chunks"}


@pytest.fixture(scope="module", params=list(PATHS))
def transport(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def coordinator(ray_hosts, transport, peaked_model, tmp_path_factory):
    workdir = tmp_path_factory.mktemp(f"coordinator-{transport}")
    yield from hosted(ray_hosts, workdir, peaked_model, kv_transport=transport)


def engine_answer(model, prompt: str, max_new_tokens: int) -> tuple[str, int]:
    """The engine alone, greedy, in this process: text and number of tokens."""
    engine = LLMEngine(EngineConfig(model_path=str(model), device="cpu", cache=CacheConfig(4, 256)))
    params = SamplingParams(max_new_tokens=max_new_tokens)
    engine.add_request(engine.request("ref", engine.tokenizer.encode(prompt), params))
    events = []
    while engine.has_work():
        events += engine.step()
    return "".join(e.text for e in events), sum(e.token_id is not None for e in events)


def metric(coordinator: HostedCoordinator, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    text = coordinator.request("GET", "external_port", "/metrics").text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(f"{name}{{"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_each_role_runs_on_its_own_host(coordinator, ray_hosts: RayOnHosts):
    nodes = {i["role"]: i["node_ip"] for i in coordinator.instances()}
    bed = ray_hosts.bed
    assert nodes == {"prefill": bed["prefill"].address, "decode": bed["decode"].address}


def test_greedy_answers_cross_the_bridge(coordinator, ray_hosts, transport, peaked_model):
    decode = ray_hosts.bed["decode"]
    before = {p: metric(coordinator, "kv_transfers_total", path=p) for p in ("shared_memory",)}
    moved_before = metric(coordinator, "kv_transfer_bytes_total")
    sent_before = metric(coordinator, "kv_transfers_total", path=PATHS[transport])
    rx_before = decode.rx_bytes()
    for prompt in PROMPTS:
        body = {"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS, "details": True}}
        response = coordinator.request("POST", "predict_port", "/infer", json=body)
        assert response.status_code == 200, response.text
        text, num_tokens = engine_answer(peaked_model, prompt, NEW_TOKENS)
        assert response.json()["generated_text"] == text
        assert response.json()["details"]["generated_tokens"] == num_tokens
    moved = metric(coordinator, "kv_transfer_bytes_total") - moved_before
    assert metric(coordinator, "kv_transfers_total", path=PATHS[transport]) - sent_before == 3
    assert (
        metric(coordinator, "kv_transfers_total", path="shared_memory") == before["shared_memory"]
    )
    assert moved > 0 and decode.rx_bytes() - rx_before >= moved  # the pages came in on eth0


def _ports(ray_hosts: RayOnHosts, coordinator: HostedCoordinator) -> tuple[int, int]:
    """The decode actor's KV endpoint port and its token channel's, read from the sockets it
    listens on on its host's address (nothing else listens there)."""
    (decode,) = [i for i in coordinator.instances() if i["role"] == "decode"]
    host = ray_hosts.bed["decode"]
    listening = host.run(["ss", "-Hltnp"]).stdout
    ports = {
        int(m.group(1))
        for line in listening.splitlines()
        if f"pid={decode['pid']}," in line
        and (m := re.search(rf"{re.escape(host.address)}\]?:(\d+)\s", line))
    }
    channel = int(decode["token_channel"].rsplit(":", 1)[1])
    assert decode["token_channel"].startswith(f"tcp://{host.address}:") and channel in ports
    (kv,) = ports - {channel}
    return kv, channel


def test_the_kv_endpoint_answers_only_the_cluster(coordinator, ray_hosts, transport):
    """A process on the prefill host without the cluster's credentials gets no answer, from
    the KV endpoint or from the token channel."""
    port, channel = _ports(ray_hosts, coordinator)
    address = ray_hosts.bed["decode"].address
    assert ray_hosts.bed["prefill"].call(lambda: _plain_zmq_answered(address, channel)) is False
    if transport == "zmq":
        assert ray_hosts.bed["prefill"].call(lambda: _plain_zmq_answered(address, port)) is False
    else:
        certificate = ray_hosts.bed["prefill"].call(
            lambda: ssl.get_server_certificate((address, port))
        )
        assert "BEGIN CERTIFICATE" in certificate  # TLS is served
        code = ray_hosts.bed["prefill"].call(lambda: _plain_grpc_push(address, port))
        assert code == grpc.StatusCode.UNAVAILABLE


def _plain_zmq_answered(address: str, port: int) -> bool:
    """Whether a plain ZMQ client gets any answer (even a refusal) from the endpoint."""
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(f"tcp://{address}:{port}")
        socket.send_multipart([b"not a header", b"no pages"])
        return bool(socket.poll(2000, zmq.POLLIN))
    finally:
        socket.close(0)
        context.term()


def _plain_grpc_push(address: str, port: int) -> grpc.StatusCode:
    with grpc.insecure_channel(f"{address}:{port}") as channel:
        try:
            pb_grpc.KVTransferStub(channel).Push(iter([pb.KVChunkMsg()]), timeout=3)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK
