"""The native token log probabilities (engine/kernels/token_logprobs.h) against torch's
log-softmax and top-k, and the sampler's two paths against each other: rows with masked
(-inf) scores, vocabularies that are not a multiple of the vector width, k from 0 to the whole
vocabulary."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine import kernels
from engine.sampler import token_logprobs
from tests.support.prerequisites import require


@pytest.fixture(scope="module")
def native():
    missing = kernels.missing_toolchain()
    require(missing is None, f"{missing}: the native kernel cannot be built here")
    return kernels.build_extension(kernels.SOURCE)


@pytest.mark.parametrize(
    "rows, vocab, k", [(1, 49152, 5), (16, 49152, 20), (3, 1000, 0), (2, 37, 37), (2, 151936, 8)]
)
def test_the_kernel_is_log_softmax_and_its_top_k(native, rows, vocab, k):
    gen = torch.Generator().manual_seed(rows * vocab + k)
    scores = torch.randn(rows, vocab, generator=gen) * 4
    scores[0, : vocab // 3] = -float("inf")  # a grammar's mask
    chosen = torch.randint(vocab // 3, vocab, (rows,), generator=gen)
    picked, values, ids = native.token_logprobs(scores, chosen, k)
    exact = torch.log_softmax(scores.double(), -1)
    assert torch.allclose(picked.double(), exact.gather(1, chosen[:, None]).squeeze(1), atol=3e-5)
    best, best_ids = torch.topk(exact, k, -1)
    finite = best.isfinite()  # masked scores tie at -inf, in an order torch leaves open
    assert torch.equal(ids[finite], best_ids[finite])
    assert torch.allclose(values.double(), best, atol=3e-5)


def test_a_row_of_equal_scores_keeps_the_first_ids_and_refuses_a_token_off_the_row(native):
    picked, values, ids = native.token_logprobs(torch.zeros(1, 100), torch.tensor([7]), 3)
    assert ids.tolist() == [[0, 1, 2]]
    assert torch.allclose(values, torch.full((1, 3), -torch.log(torch.tensor(100.0)).item()))
    assert picked.item() == pytest.approx(values[0, 0].item())
    with pytest.raises(RuntimeError, match="chosen token 100 not in"):
        native.token_logprobs(torch.zeros(1, 100), torch.tensor([100]), 3)


def test_the_sampler_gives_the_same_figures_on_either_path(native):
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(6, 4099, generator=gen) * 3
    wants = [5, -1, 0, 20, 1, 3]  # -1: a request that asks for none
    requests = [SimpleNamespace(params=SimpleNamespace(logprobs=n)) for n in wants]
    chosen = [int(row.argmax()) for row in scores]
    fast = token_logprobs(scores, requests, chosen, native)  # type: ignore[arg-type]
    plain = token_logprobs(scores, requests, chosen)  # type: ignore[arg-type]
    for asked, a, b in zip(wants, fast, plain, strict=True):
        if asked < 0:
            assert a is None and b is None
            continue
        assert a is not None and b is not None and len(a.top) == len(b.top) == asked
        assert a.logprob == pytest.approx(b.logprob, abs=3e-5)
        assert [i for i, _ in a.top] == [i for i, _ in b.top]
        for (_, x), (_, y) in zip(a.top, b.top, strict=True):
            assert x == pytest.approx(y, abs=3e-5)
