"""geomtrain.diagnostics: weight spectra and attention saturation against closed forms.

Tolerances: 1e-5 relative covers float32 SVD / norm rounding on matrices of size <= 64; softmax
rows come in as float32 probabilities (summed in float64), so their statistics get 1e-6 relative
(float32 eps 6e-8 times <= 16 terms).
"""

import math

import pytest
import torch

from geomtrain.assign import assign
from geomtrain.diagnostics import (
    attention_stats,
    collect_diagnostics,
    gradient_norms,
    matrix_stats,
    module_kind,
    softmax_row_stats,
)
from geomtrain.model import GPT, model_config


def causal(T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero logits under a causal mask (``-inf`` above the diagonal) and their softmax: row i is
    uniform over its i + 1 visible entries."""
    logits = torch.zeros(1, 1, T, T).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return logits, logits.softmax(-1)


def test_matrix_stats_of_a_known_spectrum_and_gram():
    torch.manual_seed(0)
    Q, _ = torch.linalg.qr(torch.randn(12, 4))
    s = torch.tensor([5.0, 3.0, 2.0, 0.5])
    st = matrix_stats(Q * s)  # orthogonal columns of norms s: singular values s, Gram diagonal
    assert st["sigma_max"] == pytest.approx(5.0, rel=1e-5) and st["sigma_min"] == pytest.approx(0.5, rel=1e-5)
    assert st["col_norm_min"] == pytest.approx(0.5, rel=1e-5) and st["col_norm_max"] == pytest.approx(5.0, rel=1e-5)
    assert st["col_norm_cv"] == pytest.approx(float(s.std() / s.mean()), rel=1e-5)
    assert st["gram_offdiag"] < 1e-6
    # [[1, 1], [0, 1]]: G = [[1, 1], [1, 2]], ||Off(G)||_F / ||G||_F = sqrt(2) / sqrt(7)
    assert matrix_stats(torch.tensor([[1.0, 1.0], [0.0, 1.0]]))["gram_offdiag"] == pytest.approx(math.sqrt(2 / 7))


def test_a_batch_of_matrices_is_described_as_its_stacked_rows():
    torch.manual_seed(1)
    W = torch.randn(3, 8, 8)
    assert matrix_stats(W) == pytest.approx(matrix_stats(W.reshape(24, 8)), rel=1e-6)


@pytest.mark.parametrize("T", [1, 4, 16])
def test_uniform_attention_has_entropy_log_t_and_no_saturation(T):
    logits = torch.zeros(2, 3, T, T)
    st = softmax_row_stats(logits, logits.softmax(-1))
    assert st["mean_entropy"] == pytest.approx(math.log(T), rel=1e-6, abs=1e-12)
    assert st["max_abs_logit"] == 0.0
    assert st["saturated_frac"] == (1.0 if T == 1 else 0.0)
    # ||diag(p) - p p^T||_F with p = 1/T: sqrt(1/T - 1/T^2)
    assert st["jacobian_norm"] == pytest.approx(math.sqrt(1 / T - 1 / T**2), rel=1e-6, abs=1e-12)


def test_one_hot_attention_is_saturated_with_no_gradient():
    logits = torch.full((4, 4), -30.0)
    logits.fill_diagonal_(30.0)
    st = softmax_row_stats(logits[None, None], logits[None, None].softmax(-1))
    assert st["saturated_frac"] == 1.0 and st["max_abs_logit"] == 30.0
    assert st["mean_entropy"] < 1e-20 and st["jacobian_norm"] < 1e-12


def test_causal_masked_entries_count_as_neither_logits_nor_probability():
    logits, probs = causal(8)
    st = softmax_row_stats(logits, probs)
    assert st["max_abs_logit"] == 0.0  # the -inf entries are not logits
    assert st["mean_entropy"] == pytest.approx(sum(math.log(i + 1) for i in range(8)) / 8, rel=1e-6)


def tiny_gpt(zero_attention: bool = False) -> GPT:
    torch.manual_seed(0)
    model = GPT(model_config("tiny", vocab_size=64, block_size=16))
    if zero_attention:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".attn.c_attn." in name:
                    p.zero_()
    return model


def test_attention_of_a_gpt_with_zero_queries_and_keys_is_causal_uniform():
    model = tiny_gpt(zero_attention=True).train()
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    layers = attention_stats(model, idx)
    expected = sum(math.log(i + 1) for i in range(16)) / 16  # rows of 1..16 visible tokens
    assert [st["layer"] for st in layers] == [0, 1]
    for st in layers:
        assert st["mean_entropy"] == pytest.approx(expected, rel=1e-6)  # float32 logits exactly 0
        assert st["max_abs_logit"] == 0.0
    assert model.training  # the mode is restored


def test_module_kind_of_gpt_parameter_names():
    kinds = {
        "transformer.h.0.attn.c_attn.weight": "attn_in",
        "transformer.h.1.attn.c_proj.weight": "attn_out",
        "transformer.h.0.mlp.c_fc.weight": "mlp_in",
        "transformer.h.0.mlp.c_proj.weight": "mlp_out",
        "transformer.wte.weight": "other",
    }
    assert {name: module_kind(name) for name in kinds} == kinds


def test_collect_diagnostics_and_gradient_norms_cover_every_muon_matrix_and_the_q_k_blocks():
    model = tiny_gpt()
    assignments = assign(list(model.named_parameters()), "hetero")
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    _, loss = model(idx, idx)
    loss.backward()
    norms = gradient_norms(model, assignments)
    out = collect_diagnostics(model, assignments, idx, norms)
    params = dict(model.named_parameters())
    muon = [a.name for a in assignments if a.optimizer == "muon"]
    rows = {r["name"]: r for r in out["matrices"]}
    attn = [n for n in muon if module_kind(n) == "attn_in"]
    assert set(rows) == set(muon) | {f"{n}[{part}]" for n in attn for part in "qk"}
    for name in muon:
        assert rows[name]["grad_norm"] == pytest.approx(float(params[name].grad.norm()), rel=1e-6)
    for name in attn:
        W, C = params[name].detach().reshape(-1, params[name].shape[-1]), params[name].shape[-1]
        assert rows[f"{name}[q]"]["sigma_max"] == pytest.approx(float(torch.linalg.svdvals(W[:C])[0]), rel=1e-5)
        assert rows[f"{name}[k]"]["grad_norm"] == pytest.approx(float(params[name].grad[C : 2 * C].norm()), rel=1e-6)
    assert len(out["attention"]) == 2
    assert "attention" not in collect_diagnostics(model, assignments, None)
