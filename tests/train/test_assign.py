"""Presets, custom rules (through the manifold registry) and the assignment table."""

import pytest

from geomtrain.assign import (
    PRESETS,
    Rule,
    assign,
    format_table,
    parse_rule,
    preset_rules,
    resolve_target,
    target_names,
    validate_rule,
)
from geomtrain.model import GPT, model_config
from manifolds import BoundedDGram, DGram, GramManifold, Stiefel, manifold_names, register, unregister


@pytest.fixture(scope="module")
def named():
    model = GPT(model_config("tiny", vocab_size=128))
    return list(model.named_parameters())


def _by_name(assignments):
    return {a.name: a for a in assignments}


EXPECTED = {  # preset -> (attention manifold, MLP manifold); None = AdamW
    "adamw": (None, None),
    "unconstrained": ("euclidean", "euclidean"),
    "all-stiefel": ("stiefel", "stiefel"),
    "all-dgram": ("dgram", "dgram"),
    "hetero": ("stiefel", "dgram"),
    "hetero-inv": ("dgram", "stiefel"),
}


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_assign_exactly_the_four_block_matrices(named, preset):
    table = _by_name(assign(named, preset))
    attention, mlp = EXPECTED[preset]
    for layer in range(2):
        blocks = (("attn.c_attn", attention), ("attn.c_proj", attention), ("mlp.c_fc", mlp), ("mlp.c_proj", mlp))
        for suffix, want in blocks:
            a = table[f"transformer.h.{layer}.{suffix}.weight"]
            assert a.manifold_name == want
            assert a.optimizer == ("adamw" if want is None else "muon")
            assert table[f"transformer.h.{layer}.{suffix}.bias"].optimizer == "adamw"
    for name in ("transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight"):
        assert table[name].optimizer == "adamw"


def test_manifold_instances_match_names(named):
    table = _by_name(assign(named, "hetero"))
    assert isinstance(table["transformer.h.0.attn.c_attn.weight"].manifold, Stiefel)
    assert isinstance(table["transformer.h.1.mlp.c_fc.weight"].manifold, DGram)


def test_custom_rules_take_precedence_and_unmatched_go_to_adamw(named):
    table = _by_name(assign(named, preset=None, rules=["*.h.0.attn.c_attn.weight=oblique", "*.mlp.*.weight=stiefel"]))
    assert table["transformer.h.0.attn.c_attn.weight"].manifold_name == "oblique"
    assert table["transformer.h.1.attn.c_attn.weight"].optimizer == "adamw"
    assert table["transformer.h.1.mlp.c_proj.weight"].manifold_name == "stiefel"
    over = _by_name(assign(named, preset="hetero", rules=["*.mlp.c_fc.weight=adamw"]))
    assert over["transformer.h.0.mlp.c_fc.weight"].optimizer == "adamw"
    assert over["transformer.h.0.mlp.c_proj.weight"].manifold_name == "dgram"


def test_manifold_instance_from_python(named):
    class Scaled(GramManifold):
        def project_gram(self, M):
            return M

    mine = Scaled()
    table = _by_name(assign(named, preset=None, rules=[Rule("*.attn.c_proj.weight", mine)]))
    assert table["transformer.h.0.attn.c_proj.weight"].manifold is mine
    custom = _by_name(assign(named, preset=None, rules=["*.c_fc.weight=mine"], custom_manifolds={"mine": mine}))
    assert custom["transformer.h.1.mlp.c_fc.weight"].manifold is mine


def one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert "\n" not in text, text
    return text


def test_bad_names_list_valid_choices(named):
    with pytest.raises(ValueError, match="valid: adamw, unconstrained, all-stiefel, all-dgram, hetero, hetero-inv"):
        preset_rules("hetero2")
    valid = "unknown manifold 'sphere'; valid: stiefel, dgram, oblique, euclidean, bdgram, .*adamw; parametric: NAME@"
    with pytest.raises(ValueError, match=valid) as e:
        assign(named, preset=None, rules=["*=sphere"])
    one_line(e)
    with pytest.raises(ValueError, match="GLOB=TARGET with TARGET one of: stiefel, dgram, oblique, euclidean, bdgram"):
        parse_rule("stiefel")
    with pytest.raises(ValueError, match=r"bad manifold spec 'bdgram@0': bound must be a finite number > 0") as e:
        assign(named, preset=None, rules=["*.attn.*=bdgram@0"])
    one_line(e)


# ----------------------------------------------------------------------------- rules apply to matrices
def test_manifold_rules_take_matrices_and_leave_vectors_to_adamw(named):
    # The README command: --rule '*.attn.*=stiefel' --rule '*.mlp.*=dgram' (globs that also match biases).
    assignments = assign(named, preset="hetero", rules=["*.attn.*=stiefel", "*.mlp.*=dgram"])
    table = _by_name(assignments)
    shapes = dict((n, tuple(p.shape)) for n, p in named)
    for name, a in table.items():
        in_block = ".attn." in name or ".mlp." in name
        if in_block and len(shapes[name]) == 2:
            assert (a.optimizer, a.manifold_name) == ("muon", "stiefel" if ".attn." in name else "dgram"), name
        else:
            assert (a.optimizer, a.manifold_name, a.manifold) == ("adamw", None, None), name
    text = format_table(assignments)
    assert "transformer.h.0.attn.c_attn.bias    192     adamw      -" in text
    assert "transformer.h.0.attn.c_attn.weight  192x64  muon       stiefel" in text


def test_vectors_fall_through_manifold_rules_and_matrices_take_the_first_match(named):
    table = _by_name(assign(named, preset="hetero", rules=["transformer.*=oblique", "*.ln_1.*=adamw", "*=stiefel"]))
    for name, p in named:
        want = ("muon", "oblique") if p.dim() == 2 else ("adamw", None)  # wte/wpe too: a 2-D embedding if asked
        assert (table[name].optimizer, table[name].manifold_name) == want, name


@pytest.mark.parametrize(
    "rule, match",
    [
        ("*.atn.*=stiefel", r"rule '\*\.atn\.\*=stiefel' matches no parameter; closest names: transformer\."),
        ("*.nothing=adamw", r"rule '\*\.nothing=adamw' matches no parameter; closest names: "),
        (
            "*.bias=stiefel",
            r"rule '\*\.bias=stiefel' matches no matrix \(only 13 parameter\(s\) of other shapes, "
            r"e\.g\. transformer\.h\.0\.ln_1\.bias \(64,\)\); manifold rules apply to 2-D weights",
        ),
    ],
)
def test_rule_matching_nothing_is_a_one_line_error(named, rule, match):
    with pytest.raises(ValueError, match=match) as e:
        assign(named, preset="hetero", rules=[rule])
    one_line(e)
    names = {n for n, _ in named}
    hint = str(e.value).partition("closest names: ")[2]
    assert not hint or set(hint.split(", ")) <= names  # the hint lists real parameter names


def test_preset_rules_need_not_match(named):
    # Presets target GPT-2 blocks; a model without MLPs simply has nothing for those rules.
    attn_only = [(n, p) for n, p in named if ".mlp." not in n]
    table = _by_name(assign(attn_only, "hetero"))
    assert table["transformer.h.0.attn.c_attn.weight"].manifold_name == "stiefel"


# ----------------------------------------------------------------------------- the registry in rules
def test_parametric_manifold_through_assign(named):
    table = _by_name(assign(named, preset="hetero-inv", rules=["*.attn.*.weight=BDGram@1.5"]))
    a0, a1 = table["transformer.h.0.attn.c_attn.weight"], table["transformer.h.1.attn.c_proj.weight"]
    assert type(a0.manifold) is BoundedDGram and a0.manifold.bound == 1.5 and a0.manifold_name == "bdgram@1.5"
    assert a1.manifold is a0.manifold  # one instance per distinct spec
    assert table["transformer.h.0.attn.c_attn.bias"].optimizer == "adamw"
    assert table["transformer.h.0.mlp.c_fc.weight"].manifold_name == "stiefel"  # the preset, unchanged
    two = _by_name(assign(named, preset=None, rules=["*.h.0.*.weight=bdgram@1.5", "*.h.1.*.weight=bdgram@2"]))
    m0, m1 = two["transformer.h.0.mlp.c_fc.weight"].manifold, two["transformer.h.1.mlp.c_fc.weight"].manifold
    assert (m0.bound, m1.bound) == (1.5, 2.0) and m0.key() != m1.key()


class Scaled(GramManifold):
    def __init__(self, scale=1.0):
        super().__init__()
        self.scale = float(scale)

    def project_gram(self, M):
        return M


@pytest.fixture
def registered():
    name = "test-assign-scaled"
    register(name, Scaled)
    yield name
    unregister(name)


def test_user_registered_manifold_through_assign(named, registered):
    assert registered in target_names() and target_names()[-1] == "adamw"
    table = _by_name(assign(named, preset="hetero", rules=[f"*.mlp.c_fc.weight={registered}@3"]))
    a = table["transformer.h.1.mlp.c_fc.weight"]
    assert type(a.manifold) is Scaled and a.manifold.scale == 3.0 and a.manifold_name == f"{registered}@3"
    assert validate_rule(f"*.attn.*={registered.upper()}@2").pattern == "*.attn.*"


def test_resolve_and_validate_targets(named):
    assert resolve_target("adamw") == ("adamw", None)
    label, m = resolve_target(" Stiefel ")
    assert label == "stiefel" and type(m) is Stiefel
    mine = Stiefel()
    assert resolve_target("Mine", {"mine": mine}) == ("mine", mine)
    assert validate_rule("*=mine", custom_names=("MINE",)).target == "mine"
    with pytest.raises(ValueError, match=r"rule '\*=sphere': unknown manifold 'sphere'; valid: stiefel.*adamw") as e:
        validate_rule("*=sphere")
    one_line(e)
    with pytest.raises(TypeError, match="a rule target must be a str or a GramManifold; got int"):
        resolve_target(3)
    assert set(manifold_names()) < set(target_names())


def test_table_lists_every_parameter(named):
    text = format_table(assign(named, "hetero"))
    assert text.splitlines()[0].split() == ["parameter", "shape", "optimizer", "manifold"]
    assert len(text.splitlines()) == len(named) + 2
    assert "transformer.h.0.attn.c_attn.weight  192x64" in text
