"""``python -m benchmarks.engine.kv_transfer`` at toy size (the tiny model, blocks of 4 tokens,
two rounds): the code path of a real run (one receiver process for every plane, each end with
its share of the cluster's credentials, paired rounds, the result file) in seconds; the share
each end gets; and a full page frame over CURVE."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from benchmarks.engine.kv_planes import PLANES, open_receivers, open_senders, share
from benchmarks.harness.provenance import ROOT
from engine.sampling_params import SamplingParams
from engine.transfer.base import PAGE_FRAME_BYTES, KVTransferError
from engine.transfer.payload import HandoffState, KVLayout, KVPayload
from engine.transfer.security import generate_credentials
from engine.transfer.transports import create_sender
from tests.benchmarks.engine.kv_toy import SIZES, assert_measured, toy_argv

_LAYOUT = KVLayout("fp", "layer,kv,block,slot,kv_head,head_dim", "torch.float32", 4, 2, 2, 8)
_STATE = HandoffState("r", [1, 2, 3], 3, 3, SamplingParams(), 5, 2)


def test_kv_transfer_toy_run_measures_every_plane(tiny_model_dir, tmp_path):
    out = tmp_path / "x.json"
    command = [
        sys.executable,
        "-m",
        "benchmarks.engine.kv_transfer",
        *toy_argv(tiny_model_dir, out),
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    meta = result["_meta"]
    assert meta["complete"] and meta["rounds"] == 2 and meta["sizes"] == [8, 32]
    assert (
        set(meta["planes"]) == set(PLANES) == {"zmq", "zmq_frames", "zmq_curve", "grpc", "grpc_tls"}
    )
    for name in (*PLANES, "copy"):
        assert set(result[name]) == set(SIZES), name
        for size in SIZES:
            assert_measured(result[name][size], f"{name} at {size}")
    for size in SIZES:
        assert result["prefill_ms"][size] > 0
        costs = result["encryption_cost"][size]
        assert set(costs) == {"zmq_curve/zmq_frames", "grpc_tls/grpc"}
        assert all(c is not None and c["median"] > 0 for c in costs.values()), costs
    assert "zmq_curve" in run.stdout and "results:" in run.stdout


def test_a_gated_plaintext_receiver_admits_only_the_clusters_senders():
    """A plaintext ZMQ receiver given the cluster's credentials (as a worker is) admits only
    senders with its password: :func:`share` gives both ends of every plane theirs."""
    keys, payload = (
        generate_credentials(),
        KVPayload(_LAYOUT, _STATE, torch.randn(2, 2, 1, 4, 2, 8)),
    )
    planes = {"zmq_frames": PLANES["zmq_frames"]}
    assert share(PLANES["zmq_frames"], keys.receiver).plain_password == keys.receiver.plain_password
    assert not share(PLANES["zmq_frames"], keys.receiver).encrypts
    assert share(PLANES["zmq_curve"], keys.sender) is keys.sender
    receiver = open_receivers(planes, keys.receiver)["zmq_frames"]
    member, stranger = open_senders(planes, keys.sender)["zmq_frames"], create_sender("zmq", False)
    try:
        member.send(receiver.endpoint, payload, timeout=10)
        with pytest.raises(KVTransferError, match="no answer"):
            stranger.send(receiver.endpoint, payload, timeout=1)
    finally:
        member.close()
        stranger.close()
        receiver.close()


def test_zmq_curve_carries_a_full_page_frame():
    """A payload of one full page frame arrives over CURVE: the receiver's message limit allows
    for CURVE's framing (without it, every transfer past 4 MiB got no answer: ZMQ dropped the
    sender)."""
    keys, planes = generate_credentials(), {"zmq_curve": PLANES["zmq_curve"]}
    blocks = torch.zeros(1, 2, PAGE_FRAME_BYTES // (2 * 4 * 2 * 8 * 4), 4, 2, 8)
    layout = KVLayout("fp", _LAYOUT.layout, "torch.float32", 4, 1, 2, 8)
    receiver = open_receivers(planes, keys.receiver)["zmq_curve"]
    sender = open_senders(planes, keys.sender)["zmq_curve"]
    try:
        sender.send(receiver.endpoint, KVPayload(layout, _STATE, blocks), timeout=3)
    finally:
        sender.close()
        receiver.close()
