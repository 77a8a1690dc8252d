"""The manifold registry: names and parametric specs to instances, user registration, errors."""

import pytest
import torch
from conftest import forget_manifold

import manifolds
from manifolds import (
    MANIFOLDS,
    BoundedDGram,
    DGram,
    Euclidean,
    GramManifold,
    Oblique,
    Stiefel,
    get_manifold,
    manifold_names,
    parse_spec,
    register,
    unregister,
)

BUILTIN = {"stiefel": Stiefel, "dgram": DGram, "oblique": Oblique, "euclidean": Euclidean, "bdgram": BoundedDGram}


class Scaled(GramManifold):
    """A user manifold with one required argument (Stiefel's mask; ``scale`` is only recorded)."""

    def __init__(self, scale, **kwargs):
        super().__init__(**kwargs)
        if not isinstance(scale, (int, float)) or scale <= 0:
            raise ValueError(f"scale must be a number > 0; got {scale!r}")
        self.scale = scale

    def project_gram(self, M):
        return M


@pytest.fixture
def user_name():
    """A name registered by the test and removed afterwards (the registry is process-wide)."""
    name = "test-scaled"
    yield name
    forget_manifold(name)


def one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert "\n" not in text, text
    return text


# ----------------------------------------------------------------------------- built-ins
def test_builtin_names_round_trip():
    assert manifold_names()[:5] == tuple(BUILTIN)
    for name, cls in BUILTIN.items():
        for spelling in (name, name.upper(), f" {name.capitalize()} "):
            m = get_manifold(spelling)
            assert type(m) is cls and MANIFOLDS[name] is cls
        assert get_manifold(name) is not get_manifold(name)  # a new instance each call
        assert get_manifold(name).key() == cls().key()


def test_manifolds_mapping_is_a_read_only_live_view(user_name):
    with pytest.raises(TypeError):
        MANIFOLDS["sphere"] = Stiefel  # the point of the test: the view is read-only
    assert user_name not in MANIFOLDS
    register(user_name, Scaled)
    assert MANIFOLDS[user_name] is Scaled and manifold_names()[-1] == user_name


# ----------------------------------------------------------------------------- parametric specs
@pytest.mark.parametrize(
    "spec, parsed",
    [
        ("stiefel", ("stiefel", (), {})),
        ("BDGram@1.5", ("bdgram", (1.5,), {})),
        (" bdgram @ 2 ", ("bdgram", (2,), {})),
        ("blockgram@16", ("blockgram", (16,), {})),
        ("x@-3,1e-3,svd", ("x", (-3, 1e-3, "svd"), {})),
        ("bdgram@0.5, polar_method = svd", ("bdgram", (0.5,), {"polar_method": "svd"})),
        ("dgram@polar_method=svd,max_newton_steps=5", ("dgram", (), {"polar_method": "svd", "max_newton_steps": 5})),
    ],
)
def test_parse_spec(spec, parsed):
    name, args, kwargs = parse_spec(spec)
    assert (name, args, kwargs) == parsed
    assert [type(a) for a in args] == [type(a) for a in parsed[1]]  # "2" is an int, "2.0" or "1e-3" a float


def test_parametric_specs_build_their_instances():
    m = get_manifold("bdgram@1.5")
    assert type(m) is BoundedDGram and m.bound == 1.5 and m.polar_method == "auto"
    assert get_manifold("bdgram").bound == 1.0  # the class default
    assert get_manifold("BDGram@2,polar_method=svd").polar_method == "svd"
    assert get_manifold("dgram@max_newton_steps=5").max_newton_steps == 5
    # key(): equal specs give equal geometry, different bounds different geometry (optimizer batching)
    assert get_manifold("bdgram@1.5").key() == get_manifold("BDGram@1.50").key() == BoundedDGram(1.5).key()
    assert BoundedDGram(1.5).key() != BoundedDGram(2).key() != DGram().key()
    X = 3 * torch.randn(10, 4, dtype=torch.float64)
    assert float(get_manifold("bdgram@0.7").column_norms(get_manifold("bdgram@0.7").projx(X)).max()) <= 0.7 + 1e-12


@pytest.mark.parametrize(
    "spec, match",
    [
        (
            "sphere",
            r"unknown manifold 'sphere'; valid: stiefel, dgram, oblique, euclidean, bdgram.*; parametric: NAME@ARG",
        ),
        ("@1.5", r"unknown manifold '@1.5'; valid: stiefel, dgram"),
        ("stief el", r"unknown manifold 'stief el' \(did you mean 'stiefel'\?\); valid: stiefel"),
        ("stifel", r"unknown manifold 'stifel' \(did you mean 'stiefel'\?\); valid: stiefel"),
        ("DGarm@2", r"unknown manifold 'DGarm@2' \(did you mean 'dgram'\?\); valid: stiefel"),
        (
            "bdgram@big",
            r"bad manifold spec 'bdgram@big': bound must be a finite number > 0; got 'big'; "
            r"bdgram takes \(bound=1.0, polar_method='auto'\)",
        ),
        ("bdgram@0", r"bound must be a finite number > 0; got 0"),
        ("bdgram@nan", r"bound must be a finite number > 0; got nan"),
        ("bdgram@1,2,3", r"bad manifold spec 'bdgram@1,2,3': .*takes from 1 to 3 positional arguments"),
        ("bdgram@", r"bad arguments in manifold spec 'bdgram@': write NAME@ARG\[,ARG\|KEY=VALUE...\], e.g. bdgram@1.5"),
        ("bdgram@1,,", r"bad arguments in manifold spec"),
        ("bdgram@=1", r"bad arguments in manifold spec"),
        ("bdgram@bound=", r"bad arguments in manifold spec"),
        ("bdgram@bound=1,2", r"positional argument after KEY=VALUE"),
        ("stiefel@3", r"unknown polar_method 3; valid: auto, svd, polar_express, newton_schulz"),
        ("dgram@max_newton_steps=0", r"max_newton_steps must be an integer >= 1; got 0"),
        ("oblique@shape=3", r"unexpected keyword argument 'shape'"),
    ],
)
def test_bad_specs_are_one_line_errors_naming_the_choices(spec, match):
    with pytest.raises(ValueError, match=match) as exc_info:
        get_manifold(spec)
    one_line(exc_info)


def test_spec_must_be_a_string():
    with pytest.raises(TypeError, match="must be a str; got int"):
        get_manifold(3)


# ----------------------------------------------------------------------------- user registration
def test_user_registration_round_trip(user_name):
    assert register(user_name, Scaled) is Scaled
    m = get_manifold(f"{user_name.upper()}@2.5")
    assert type(m) is Scaled and m.scale == 2.5
    assert m.key() != get_manifold(f"{user_name}@3").key()
    with pytest.raises(ValueError, match=f"bad manifold spec '{user_name}': .*missing 1 required positional"):
        get_manifold(user_name)
    refused = r"scale must be a number > 0; got 'big'; test-scaled takes \(scale, \*\*kwargs\)"
    with pytest.raises(ValueError, match=refused):
        get_manifold(f"{user_name}@big")
    unregister(user_name)
    with pytest.raises(ValueError, match=f"unknown manifold '{user_name}@2'"):
        get_manifold(f"{user_name}@2")


def test_factory_may_be_any_callable(user_name):
    register(user_name, lambda block=2: Scaled(block, polar_method="svd"))
    assert get_manifold(user_name).scale == 2 and get_manifold(f"{user_name}@5").polar_method == "svd"


def test_reregistering_needs_overwrite(user_name):
    register(user_name, Scaled)
    with pytest.raises(ValueError, match=f"manifold '{user_name}' is already registered .*pass overwrite=True") as e:
        register(user_name.upper(), Stiefel)
    one_line(e)
    with pytest.raises(ValueError, match="'stiefel' is already registered"):
        register("stiefel", Scaled)
    register(user_name, Stiefel, overwrite=True)
    assert type(get_manifold(user_name)) is Stiefel
    assert type(get_manifold("stiefel")) is Stiefel  # the failed attempt left the built-in alone


@pytest.mark.parametrize("bad", ["", "a@b", "a=b", "a,b", "a b", "tab\t", "new\nline", "bdgram@1.5"])
def test_bad_names_are_refused(bad):
    with pytest.raises(ValueError, match="bad manifold name .*no '@', '=', ',' or whitespace") as e:
        register(bad, Scaled)
    one_line(e)
    assert bad.lower() not in manifold_names()


def test_bad_factories_are_refused(user_name):
    with pytest.raises(TypeError, match="must be a GramManifold subclass or a callable; got str"):
        register(user_name, "Stiefel")
    with pytest.raises(TypeError, match="a manifold name must be a str"):
        register(3, Scaled)
    register(user_name, lambda: torch.eye(3))
    with pytest.raises(TypeError, match=f"the factory of manifold '{user_name}' returned Tensor, not a GramManifold"):
        get_manifold(user_name)


def test_unregister_unknown_name_names_the_choices():
    with pytest.raises(ValueError, match="manifold 'sphere' is not registered; valid: stiefel, dgram"):
        unregister("sphere")


def test_public_names_of_the_package():
    for name in (
        "register",
        "unregister",
        "manifold_names",
        "parse_spec",
        "get_manifold",
        "MANIFOLDS",
        "BoundedDGram",
        "SPEC_SYNTAX",
    ):
        assert name in manifolds.__all__ and hasattr(manifolds, name)
