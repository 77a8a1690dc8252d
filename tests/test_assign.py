"""Presets, custom rules and the assignment table."""
import pytest
import torch

from geomtrain.assign import PRESETS, Rule, assign, format_table, parse_rule, preset_rules
from geomtrain.model import GPT, model_config
from manifolds import DGram, GramManifold, Stiefel


@pytest.fixture(scope="module")
def named():
    model = GPT(model_config("tiny", vocab_size=128))
    return list(model.named_parameters())


def _by_name(assignments):
    return {a.name: a for a in assignments}


EXPECTED = {  # preset -> (attention manifold, MLP manifold); None = AdamW
    "adamw": (None, None), "unconstrained": ("euclidean", "euclidean"), "all-stiefel": ("stiefel", "stiefel"),
    "all-dgram": ("dgram", "dgram"), "hetero": ("stiefel", "dgram"), "hetero-inv": ("dgram", "stiefel"),
}


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_assign_exactly_the_four_block_matrices(named, preset):
    table = _by_name(assign(named, preset))
    attention, mlp = EXPECTED[preset]
    for layer in range(2):
        for suffix, want in (("attn.c_attn", attention), ("attn.c_proj", attention), ("mlp.c_fc", mlp), ("mlp.c_proj", mlp)):
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


def test_bad_names_list_valid_choices(named):
    with pytest.raises(ValueError, match="valid: adamw, unconstrained, all-stiefel, all-dgram, hetero, hetero-inv"):
        preset_rules("hetero2")
    with pytest.raises(ValueError, match="valid: stiefel, dgram, oblique, euclidean, adamw"):
        assign(named, preset=None, rules=["*=sphere"])
    with pytest.raises(ValueError, match="GLOB=TARGET"):
        parse_rule("stiefel")
    with pytest.raises(ValueError, match="only 2-D weights"):
        assign(named, preset=None, rules=["*.bias=stiefel"])


def test_table_lists_every_parameter(named):
    text = format_table(assign(named, "hetero"))
    assert text.splitlines()[0].split() == ["parameter", "shape", "optimizer", "manifold"]
    assert len(text.splitlines()) == len(named) + 2
    assert "transformer.h.0.attn.c_attn.weight  192x64" in text
