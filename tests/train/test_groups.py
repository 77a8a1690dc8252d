"""param_groups on models that are not our GPT: MLP, CNN (kernel views), Hugging Face GPT-2 (Conv1D layout).

Tolerances: constraints are checked in float32 against 1e-5 (`manifolds.base`'s float32 check
tolerance: rounding of an O(1) Gram product is ~n * 6e-8 for n <= 128 here); equalities of the
same float32 computation done two ways against 1e-6 (a few ulps of O(1) entries).
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import geomtrain
from geomtrain.assign import Rule
from geomtrain.groups import CONV_VIEWS, MatrixView, logical_parameters, param_groups
from geomtrain.optim import ManifoldMuon
from manifolds import BoundedDGram, DGram, Stiefel

ATOL32 = 1e-5


def one_line(exc_info):
    assert "\n" not in str(exc_info.value)


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 24), nn.Tanh(), nn.Linear(24, 5))


def cnn(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 16, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 4 * 4, 10)
    )


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.body = nn.Linear(16, 16)
        self.lm_head = nn.Linear(16, 50, bias=False)

    def forward(self, idx):
        return self.lm_head(torch.tanh(self.body(self.emb(idx))))


def smaller_gram(W):
    """W^T W for a tall (or square) matrix, W W^T for a wide one: the Gram the manifolds constrain."""
    return W.mT @ W if W.shape[-2] >= W.shape[-1] else W @ W.mT


def on_manifold(manifold, W):
    G = smaller_gram(W.detach())
    eye = torch.eye(G.shape[-1], dtype=G.dtype)
    if isinstance(manifold, Stiefel):
        return float((G - eye).abs().max()) < ATOL32
    assert isinstance(manifold, DGram)
    scale = G.diagonal(dim1=-2, dim2=-1).amax(-1)[..., None, None]
    return float(((G * (1 - eye)).abs() / scale).max()) < ATOL32


def step(model, groups, loss_fn, lr=0.02):
    muon = ManifoldMuon(groups.muon, lr=lr)
    adamw = torch.optim.AdamW(groups.adamw, lr=1e-3)
    loss = loss_fn(model)
    loss.backward()
    muon.step()
    adamw.step()
    model.zero_grad()
    return float(loss.detach())


# ---------------------------------------------------------------------------------------- MLP
def test_mlp_groups_matrices_to_muon_vectors_to_adamw_without_decay():
    model = mlp()
    g = param_groups(model, rules={"0.weight": "stiefel", "2.*": "dgram"}, weight_decay=0.1)
    by_name = {a.name: a for a in g.assignments}
    assert (by_name["0.weight"].manifold_name, by_name["2.weight"].manifold_name) == ("stiefel", "dgram")
    assert by_name["2.bias"].optimizer == "adamw"  # a manifold glob takes the matrix only
    assert by_name["4.weight"].optimizer == "adamw"
    assert [(grp["manifold_name"], [id(p) for p in grp["params"]]) for grp in g.muon] == [
        ("stiefel", [id(model[0].weight)]),
        ("dgram", [id(model[2].weight)]),
    ]
    matrices, vectors = g.adamw
    assert [id(p) for p in matrices["params"]] == [id(model[4].weight)] and matrices["weight_decay"] == 0.1
    assert {id(p) for p in vectors["params"]} == {id(model[i].bias) for i in (0, 2, 4)}
    assert vectors["weight_decay"] == 0.0
    assert "weight_decay" not in param_groups(mlp(), rules=["0.weight=stiefel"]).adamw[0]  # AdamW's default


def test_every_parameter_is_in_exactly_one_group_and_once_in_the_table():
    for model, kwargs in (
        (mlp(), {"rules": ["*=stiefel"]}),
        (cnn(), {"rules": ["*=dgram"], "conv": "batch"}),
        (TinyLM(), {"rules": ["*=stiefel"]}),
    ):
        g = param_groups(model, **kwargs)
        grouped = [id(p) for grp in g.muon + g.adamw for p in grp["params"]]
        assert sorted(grouped) == sorted(id(p) for p in model.parameters())
        names = [n for n, _ in logical_parameters(model)[0]]
        rows = g.table().splitlines()[2:]
        listed = [r.split()[0] for r in rows]
        assert listed == [a.name for a in g.assignments] and len(set(listed)) == len(listed)
        assert sorted(listed) == sorted(names)  # a re-parametrised kernel moves in named_parameters' order
        assert str(g) == g.table()


def test_rules_as_strings_rule_objects_and_a_mapping_agree():
    forms = (
        ["0.*=stiefel", "2.weight=bdgram@1.5"],
        [Rule("0.*", "stiefel"), Rule("2.weight", "bdgram@1.5")],
        {"0.*": "stiefel", "2.weight": "bdgram@1.5"},
    )
    tables = [param_groups(mlp(), rules=r, project=False).table() for r in forms]
    assert tables[0] == tables[1] == tables[2]
    assert "bdgram@1.5" in tables[0]


def test_manifold_instances_each_keep_their_own_group():
    model = mlp()
    loose, tight = BoundedDGram(2.0), BoundedDGram(1.0)
    g = param_groups(model, rules=[Rule("0.weight", loose), Rule("2.weight", tight)])
    assert [(grp["manifold"], [id(p) for p in grp["params"]]) for grp in g.muon] == [
        (loose, [id(model[0].weight)]),
        (tight, [id(model[2].weight)]),
    ]


def test_constrained_matrices_are_projected_and_the_distance_reported():
    model = mlp()
    before = model[0].weight.detach().clone()
    g = param_groups(model, rules=["0.weight=stiefel", "2.weight=euclidean"])
    assert set(g.moved) == {"0.weight"}  # Euclidean Muon has nothing to project onto
    after = model[0].weight.detach()
    assert g.moved["0.weight"] == pytest.approx(float((after - before).norm() / before.norm()), rel=1e-5)
    assert g.moved["0.weight"] > 0.1 and on_manifold(Stiefel(), model[0].weight)
    untouched = mlp()
    param_groups(untouched, rules=["0.weight=stiefel"], project=False)
    assert torch.equal(untouched[0].weight, mlp()[0].weight)


@pytest.mark.slow
def test_a_few_steps_on_the_mlp_reduce_the_loss_and_stay_on_the_manifolds():
    torch.manual_seed(1)
    x = torch.randn(256, 16)
    y = (x[:, :5] * 2 + 0.3 * x[:, 5:10]).argmax(1)  # a learnable 5-class problem
    model = mlp()
    g = param_groups(model, rules={"0.weight": "stiefel", "2.weight": "dgram"})
    muon, adamw = ManifoldMuon(g.muon, lr=0.05), torch.optim.AdamW(g.adamw, lr=3e-3)
    losses = []
    for _ in range(40):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        muon.step()
        adamw.step()
        model.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0], losses[::10]
    assert on_manifold(Stiefel(), model[0].weight) and on_manifold(DGram(), model[2].weight)


# ------------------------------------------------------------------------------ embeddings, lm_head
def test_embeddings_and_lm_head_go_to_adamw_unless_asked():
    by_name = lambda g: {a.name: a.manifold_name for a in g.assignments}  # noqa: E731
    assert by_name(param_groups(TinyLM(), rules=["*=stiefel"])) == {
        "emb.weight": None,
        "body.weight": "stiefel",
        "body.bias": None,
        "lm_head.weight": None,
    }
    both = by_name(param_groups(TinyLM(), rules=["*=stiefel"], embeddings="rules", lm_head="rules"))
    assert both["emb.weight"] == both["lm_head.weight"] == "stiefel"
    with pytest.raises(
        ValueError,
        match=r"rule 'emb\.\*=stiefel' matches no matrix \(only 1 parameter\(s\) it may "
        r"not take, e\.g\. emb\.weight \(50, 16\)\); manifold rules apply to .*"
        r"other than embeddings and lm_head \(set embeddings='rules' or "
        r"lm_head='rules' to include them\)",
    ) as e:
        param_groups(TinyLM(), rules=["emb.*=stiefel"])
    one_line(e)


# ---------------------------------------------------------------------------------------- CNN
def test_a_kernel_on_muon_needs_a_view():
    with pytest.raises(
        ValueError,
        match=r"^0\.weight is a 4-dim kernel \(8x3x3x3\) matched by a Muon rule "
        r"\(stiefel\); say how to view it: conv='flatten' or conv='batch', or send "
        r"it to AdamW with a rule '0\.weight=adamw' first$",
    ) as e:
        param_groups(cnn(), rules=["*=stiefel"])
    one_line(e)
    g = param_groups(cnn(), rules=["5.weight=stiefel", "*.weight=adamw"])  # kernels to AdamW: no view
    assert g.views == {} and [a.name for a in g.assignments if a.optimizer == "muon"] == ["5.weight"]
    model = cnn()
    with pytest.raises(ValueError, match=r"^2\.weight: conv='batch' needs a manifold target; Euclidean Muon flattens"):
        param_groups(model, rules=["0.weight=stiefel", "2.weight=euclidean"], conv="batch")
    assert not parametrize.is_parametrized(model[0])  # checked before anything changed


@pytest.mark.parametrize("view", CONV_VIEWS)
def test_kernel_views_keep_the_forward_and_store_the_matrices(view):
    model, reference = cnn(), cnn()
    x = torch.randn(2, 3, 8, 8)
    g = param_groups(model, rules=["*=stiefel"], conv=view, project=False)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)  # same kernel, viewed
    stored = model[2].parametrizations.weight.original
    assert g.parameters["2.weight"] is stored and g.views == {"0.weight": view, "2.weight": view}
    kernel = reference[2].weight.detach()
    if view == "flatten":
        assert stored.shape == (16, 8 * 9) and torch.equal(stored, kernel.reshape(16, -1))
    else:
        assert stored.shape == (9, 16, 8) and torch.equal(stored[5], kernel[:, :, 1, 2])  # tap 5 = (1, 2)
    assert {a.name: a.shape for a in g.assignments}["2.weight"] == tuple(stored.shape)
    assert f"kernel {view}" in g.table()


@pytest.mark.parametrize("view", CONV_VIEWS)
def test_a_manifold_muon_step_keeps_each_viewed_kernel_on_its_manifold(view):
    model = cnn()
    g = param_groups(model, rules=["0.weight=dgram", "2.weight=stiefel"], conv=view)
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3])
    for _ in range(2):
        step(model, g, lambda m: nn.functional.cross_entropy(m(x), y))
    for i, manifold in ((0, DGram()), (2, Stiefel())):
        kernel = model[i].weight.detach()  # (out, in, 3, 3), what the conv uses
        matrices = kernel.reshape(kernel.shape[0], -1) if view == "flatten" else kernel.permute(2, 3, 0, 1)
        assert on_manifold(manifold, matrices), (i, view)
    assert not on_manifold(
        Stiefel(),
        model[2].weight.detach().permute(2, 3, 0, 1) if view == "flatten" else model[2].weight.detach().reshape(16, -1),
    )  # the other view is not constrained


def test_flattened_kernels_get_the_same_euclidean_muon_update_as_muon_itself():
    # ManifoldMuon flattens a 4-D tensor to (out, -1) on its Euclidean path: conv="flatten" must match it.
    viewed, plain = cnn(), cnn()
    g = param_groups(viewed, rules=["*.weight=euclidean"], conv="flatten")
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3])
    loss_fn = lambda m: nn.functional.cross_entropy(m(x), y)  # noqa: E731
    step(viewed, g, loss_fn)
    ref = ManifoldMuon([plain[i].weight for i in (0, 2, 5)], lr=0.02)
    loss_fn(plain).backward()
    ref.step()
    for i in (0, 2, 5):
        torch.testing.assert_close(viewed[i].weight, plain[i].weight, rtol=0, atol=1e-6)


def test_a_viewed_model_keeps_its_view_on_a_second_call():
    model = cnn()
    first = param_groups(model, rules=["*=stiefel"], conv="flatten")
    again = param_groups(model, rules=["*=stiefel"])  # no conv needed: the kernel is stored as a matrix
    assert sorted(a.name for a in again.assignments) == sorted(a.name for a in first.assignments)
    assert again.views == first.views and max(again.moved.values()) < 1e-5  # already on Stiefel
    with pytest.raises(ValueError, match=r"0\.weight is already viewed as conv='flatten'"):
        param_groups(model, rules=["*=stiefel"], conv="batch")
    assert isinstance(model[0].parametrizations.weight[0], MatrixView)
    kernel = model[0].weight.detach().clone()
    parametrize.remove_parametrizations(model[0], "weight")  # the way back to a plain module (docs)
    assert "0.weight" in model.state_dict() and torch.equal(model[0].weight, kernel)


# ---------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"rules": ["0.weight=sphere"]}, ValueError, r"unknown manifold 'sphere'; valid: stiefel, dgram, .*adamw"),
        ({"rules": ["9.*=stiefel"]}, ValueError, r"rule '9\.\*=stiefel' matches no parameter; closest names: "),
        ({"rules": ["0.weight"]}, ValueError, r"rule '0\.weight' must look like GLOB=TARGET"),
        ({"preset": "hetero-x"}, ValueError, r"unknown preset 'hetero-x'; valid: adamw, unconstrained"),
        ({"embeddings": "muon"}, ValueError, r"embeddings='muon'; valid: 'adamw', 'rules'"),
        ({"lm_head": None}, ValueError, r"lm_head=None; valid: 'adamw', 'rules'"),
        ({"conv": "unfold"}, ValueError, r"conv='unfold'; valid: 'flatten', 'batch' or None"),
    ],
)
def test_bad_input_is_a_one_line_error(kwargs, error, match):
    with pytest.raises(error, match=match) as e:
        param_groups(mlp(), **kwargs)
    one_line(e)


def test_not_a_module_is_a_type_error():
    with pytest.raises(TypeError, match="param_groups needs a torch.nn.Module; got list"):
        param_groups(list(mlp().parameters()))


def test_the_package_exports_param_groups_lazily():
    assert geomtrain.param_groups is param_groups
    probe = "import sys, geomtrain; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout == "False\n"
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        geomtrain.nope  # noqa: B018


# ---------------------------------------------------------------------------- Hugging Face GPT-2
@pytest.fixture
def hf_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.slow
def test_hf_gpt2_conv1d_constrains_the_smaller_gram(hf_gpt2):
    model = hf_gpt2
    assert model.transformer.h[0].mlp.c_fc.weight.shape == (32, 128)  # Conv1D: (in, out), unlike nn.Linear
    g = param_groups(model, preset="hetero")
    muon = {a.name: a for a in g.assignments if a.optimizer == "muon"}
    assert len(muon) == 8 and all(".attn." in n or ".mlp." in n for n in muon)
    by_name = {a.name: a.optimizer for a in g.assignments}
    assert by_name["transformer.wte.weight"] == "adamw"  # tied with lm_head: one parameter, an embedding
    assert "lm_head.weight" not in by_name
    idx = torch.randint(0, 64, (2, 16))
    for _ in range(2):
        step(model, g, lambda m: m(idx, labels=idx).loss)
    for name, a in muon.items():
        W = g.parameters[name].detach()
        assert smaller_gram(W).shape == (32, 32), name  # n_embd: the smaller side of (32, 96), (128, 32), ...
        assert on_manifold(a.manifold, W), name
        if W.shape[0] != W.shape[1] and a.manifold_name == "stiefel":  # the larger Gram has rank 32 < its size
            larger = W @ W.mT if W.shape[0] > W.shape[1] else W.mT @ W
            assert float((larger - torch.eye(larger.shape[0])).abs().max()) > 0.5, name


@pytest.mark.parametrize("manifold", [Stiefel(), DGram()])
def test_the_constraint_does_not_depend_on_the_layout(manifold):
    # Conv1D stores W^T of the nn.Linear weight W: projecting either layout gives the same layer.
    torch.manual_seed(2)
    for shape in ((32, 96), (128, 32)):
        W = torch.randn(*shape, dtype=torch.float64)
        torch.testing.assert_close(manifold.projx(W.mT), manifold.projx(W).mT, rtol=0, atol=1e-12)


def test_hf_gpt2_any_matrix_rule_keeps_embeddings_on_adamw(hf_gpt2):
    g = param_groups(hf_gpt2, rules=["*=dgram"])
    muon = [a.name for a in g.assignments if a.optimizer == "muon"]
    assert len(muon) == 8 and not any("wte" in n or "wpe" in n for n in muon)


# ---------------------------------------------------------------------------------------- the docs page
DOCS = Path(__file__).resolve().parents[2] / "docs" / "any-model.md"


def fenced(language):
    return re.findall(rf"```{language}\n(.*?)```", DOCS.read_text(), flags=re.S)


def test_the_docs_usage_runs_and_prints_the_table_shown(capsys):
    exec(compile(fenced("python")[0], str(DOCS), "exec"), {})
    assert capsys.readouterr().out == fenced("text")[0]


def test_the_docs_error_messages_are_the_real_ones():
    def message(model, **kwargs):
        with pytest.raises(ValueError) as e:
            param_groups(model, **kwargs)
        return str(e.value)

    docs_mlp = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 10))
    shown = fenced("text")[1].splitlines()
    assert shown == [
        message(docs_mlp, rules=["0.weight=sphere"]),
        message(docs_mlp, rules=["9.*=stiefel"]),
        message(TinyLM(), rules=["emb.*=stiefel"]),
    ]
    assert fenced("text")[2].strip() == message(nn.Sequential(nn.Conv2d(1, 8, 3)), rules=["*=stiefel"])


def test_euclidean_muon_reads_the_stored_layout_as_out_in():
    # The docs' note: Conv1D c_fc (in=32, out=128) gets shape factor 1, its nn.Linear layout (128, 32) gets 2.
    torch.manual_seed(3)
    G = torch.randn(32, 128)
    conv1d, linear = nn.Parameter(torch.zeros(32, 128)), nn.Parameter(torch.zeros(128, 32))
    conv1d.grad, linear.grad = G.clone(), G.mT.clone()
    ManifoldMuon([conv1d, linear], lr=0.02, momentum=0.0, nesterov=False).step()
    torch.testing.assert_close(linear.detach(), 2 * conv1d.detach().mT, rtol=1e-4, atol=1e-6)
