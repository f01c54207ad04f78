"""The accuracy gate's parts: teacher forcing through the decode path gives the logits a prompt
of each prefix gives, KL and top-1 from log-probabilities, llama-perplexity's report parsed, and
a toy run of ``python -m benchmarks.engine.accuracy`` on a random GGUF."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks import report
from benchmarks.engine import accuracy
from benchmarks.engine.accuracy_peer import parse_kl_report, perplexity_command
from benchmarks.llamacpp.random_gguf import tiny_shape, write_random_gguf
from engine.sampling_params import SamplingParams
from tests.conftest import make_engine

KL_REPORT = """
====== Perplexity statistics ======
Mean PPL(Q)                   :  17.512345 ±   0.601234
Mean PPL(base)                :  17.401234 ±   0.597777
Cor(ln(PPL(Q)), ln(PPL(base))):  99.81%
====== KL divergence statistics ======
Mean    KLD:   0.012345 ±   0.000456
Maximum KLD:   0.876543
99.9%   KLD:   0.301234
99.0%   KLD:   0.098765
Median  KLD:   0.006543
====== Token probability statistics ======
Same top p: 97.123 ± 0.345 %
"""


def test_windows_are_whole_and_counted():
    assert accuracy.windows_of(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert accuracy.windows_of(list(range(10)), 4, count=1) == [[0, 1, 2, 3]]
    assert accuracy.windows_of(list(range(3)), 4) == []


def test_forced_decode_gives_the_logits_of_each_prefix_as_a_prompt(tiny_loaded):
    # each prompt computed whole; float32 pages, as a prompt attends to its own keys and values
    tiny_engine = make_engine(tiny_loaded, prefix_caching=False, kv_cache_dtype="float32")
    windows = [[5, 9, 14, 3, 7, 22, 8, 11], [40, 2, 19, 6, 33, 12, 25, 4]]
    rows = []
    run = tiny_engine.runner.run

    def counting(scheduled, *hooks):
        logits, samplers = run(scheduled, *hooks)
        rows.append(len(samplers))
        return logits, samplers

    tiny_engine.runner.run = counting
    one_by_one = accuracy.forced_logits(tiny_engine, windows, batch=1)
    assert max(rows) == 1  # never more windows a step than asked
    tiny_engine.runner.run = run
    forced = accuracy.forced_logits(tiny_engine, windows)
    assert [tuple(f.shape[:1]) for f in forced] == [(7,), (7,)]
    for alone, together in zip(one_by_one, forced, strict=True):
        assert torch.allclose(alone, together, atol=1e-3, rtol=1e-4)
    for w, window in enumerate(windows):
        for n in (1, 4, 7):
            params = SamplingParams(max_new_tokens=1, ignore_eos=True)
            tiny_engine.add_request(tiny_engine.request(f"p{w}{n}", window[:n], params))
            seen = {}
            run = tiny_engine.runner.run

            def recording(scheduled, *hooks, seen=seen, run=run):
                logits, samplers = run(scheduled, *hooks)
                seen.update((r.request_id, logits[i].clone()) for i, r in enumerate(samplers))
                return logits, samplers

            tiny_engine.runner.run = recording
            while tiny_engine.has_work():
                tiny_engine.step()
            tiny_engine.runner.run = run
            prompt_logits = seen[f"p{w}{n}"].double()
            assert torch.allclose(forced[w][n - 1], prompt_logits, atol=1e-3, rtol=1e-4)


def test_windows_as_prompts_give_every_positions_logits_as_forced_decode_does(tiny_loaded):
    tiny_engine = make_engine(tiny_loaded, prefix_caching=False, kv_cache_dtype="float32")
    windows = [[5, 9, 14, 3, 7, 22, 8, 11], [40, 2, 19, 6, 33, 12, 25, 4], [1, 2, 3, 4, 5, 6]]
    forced = accuracy.forced_logits(tiny_engine, windows)
    as_prompts = accuracy.prompt_logits(tiny_engine, windows, batch=2)
    assert [p.shape[0] for p in as_prompts] == [7, 7, 5]
    for decoded, prompted in zip(forced, as_prompts, strict=True):
        assert torch.allclose(decoded, prompted, atol=1e-3, rtol=1e-4)
    assert "run" not in vars(tiny_engine.runner)  # the runner's own run again
    assert (
        not tiny_engine.has_work()
        and tiny_engine.blocks.num_free_blocks == tiny_engine.blocks.num_blocks
    )


def test_divergence_of_a_distribution_from_itself_is_nothing_and_grows_when_moved():
    logits = torch.randn(50, 30, dtype=torch.float64)
    reference = torch.log_softmax(logits, -1)
    targets = torch.randint(0, 30, (50,))
    same = accuracy.divergence(reference, reference, targets)
    assert same["kl_mean"] == 0 and same["top1_agreement"] == 1.0
    assert same["perplexity"] == same["perplexity_reference"]
    moved = accuracy.divergence(
        reference, torch.log_softmax(logits + torch.randn(50, 30), -1), targets
    )
    assert moved["kl_mean"] > 0.01 and moved["top1_agreement"] < 1.0
    assert moved["kl_p99"] >= moved["kl_mean"] and moved["kl_max"] >= moved["kl_p99"]
    uniform = torch.full((4, 8), -math.log(8), dtype=torch.float64)
    assert accuracy.perplexity(uniform, torch.tensor([0, 1, 2, 3])) == pytest.approx(8.0)


def test_a_setting_passes_only_under_llamacpps_kl_and_over_the_top1_floor():
    entry = {
        "settings": {
            "a": {"kl_mean": 0.01, "top1_agreement": 0.99},
            "b": {"kl_mean": 0.03, "top1_agreement": 0.99},
            "c": {"kl_mean": 0.001, "top1_agreement": 0.97},
        },
        "llamacpp": {"kl_mean": 0.02},
    }
    assert accuracy.verdicts(entry) == {"a": "passes", "b": "fails", "c": "fails"}
    del entry["llamacpp"]
    assert accuracy.verdicts(entry)["a"] == "undecided"


def test_llama_perplexity_report_is_parsed_and_its_command_names_the_base(tmp_path):
    figures = parse_kl_report(KL_REPORT)
    assert figures == {
        "kl_mean": 0.012345, "kl_mean_se": 0.000456, "kl_p99": 0.098765, "kl_max": 0.876543,
        "top1_agreement": 0.97123,
        "perplexity": 17.512345, "perplexity_reference": 17.401234,
    }  # fmt: skip
    with pytest.raises(RuntimeError, match="no kl_mean"):
        parse_kl_report("Mean PPL(Q) : 1.0")
    command = perplexity_command(
        tmp_path, tmp_path / "m.gguf", tmp_path / "t.txt", 128, 9, 2, tmp_path / "b"
    )
    assert command[:3] == [str(tmp_path / "llama-perplexity"), "-m", str(tmp_path / "m.gguf")]
    assert command[command.index("--kl-divergence-base") + 1] == str(tmp_path / "b")
    assert (
        command[command.index("--chunks") + 1] == "9" and command[command.index("-c") + 1] == "128"
    )


def test_a_toy_run_writes_each_setting_against_float32(tmp_path):
    gguf = write_random_gguf(tmp_path / "tiny.gguf", "tiny", tiny_shape("llama"))
    out = tmp_path / "accuracy.json"
    argv = ["--scratch", "--out", str(out), "--gguf", str(gguf), "--ctx", "32", "--windows", "2"]
    accuracy.main([*argv, "--no-peer"])
    result = json.loads(out.read_text())
    assert result["_meta"]["complete"] and result["ctx"] == 32
    entry = result["files"][str(gguf)]
    assert entry["windows"] == 2 and entry["text_tokens"] >= 64
    assert list(entry["settings"]) == [*accuracy.SETTINGS, *accuracy.PROMPT_SETTINGS]
    for setting, figures in entry["settings"].items():
        assert figures["tokens"] == 2 * (32 - 32 // 2 - 1)
        assert figures["perplexity"] > 1 and figures["top1_agreement"] > 0.9
        assert figures["kl_mean"] < 0.05, setting
        assert entry["verdicts"][setting] in ("undecided", "fails")
    # each setting ran as named (on the toy file its KL rounds to 0 or nearly)
    assert entry["settings"]["kv_bfloat16"]["runs"] == {
        "activations": "float32",
        "kv_cache": "torch.bfloat16",
        "prompts": "float32",
    }
    assert entry["settings"]["int8_kv_float16"]["runs"] == {
        "activations": "int8",
        "kv_cache": "torch.float16",
        "prompts": "float32",
    }
    assert entry["settings"]["prompt_bfloat16"]["runs"]["prompts"] == "bfloat16"
    figures = entry["settings"]["int8"]
    assert "llamacpp" not in entry
    table = report.RENDERERS["accuracy"](result)
    assert f"| {gguf} | int8 | {figures['tokens']} |" in table
    assert table.rstrip().endswith("| - | - | undecided |")
