"""One source of truth for ``CodecParams``: the Rust core's ``CodecParams::default()``
(``_core.codec_params_defaults()``). Every other place that lists the fields or their defaults
(the constructor's signature, ``to_dict()``, the properties, the ``.pyi`` stub and the
``bench`` flags) must agree with it, so a field added or a default changed in one place only
fails here."""

from __future__ import annotations

import argparse
import ast
import inspect
import math
import pickle
from pathlib import Path

import pytest

import kakeyaturbo as kt
from kakeyaturbo import _core, bench_cli

STUB = Path(kt.__file__).with_name("_core.pyi")

DEFAULTS = _core.codec_params_defaults()
FIELDS = list(DEFAULTS)


def _stub_class(name: str) -> ast.ClassDef:
    tree = ast.parse(STUB.read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _stub_members(kind: type, name: str = "CodecParams") -> list:
    return [n for n in _stub_class(name).body if isinstance(n, kind)]


def _stub_constructor() -> ast.arguments:
    new = next(n for n in _stub_members(ast.FunctionDef) if n.name == "__new__")
    assert not new.args.args[1:] and not new.args.defaults, "CodecParams takes keywords only"
    assert all(d is not None for d in new.args.kw_defaults), "every field has a default"
    return new.args


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b)
    return type(a) is type(b) and a == b


def test_core_defaults_build_the_default_params():
    assert kt.CodecParams(**DEFAULTS) == kt.CodecParams()


def test_constructor_signature_matches_core_defaults():
    params = inspect.signature(kt.CodecParams).parameters
    assert list(params) == FIELDS
    for name, p in params.items():
        assert p.kind is inspect.Parameter.KEYWORD_ONLY, name
        assert _same(p.default, DEFAULTS[name]), (name, p.default, DEFAULTS[name])


def test_to_dict_and_properties_match_core_defaults():
    p = kt.CodecParams()
    d = p.to_dict()
    assert list(d) == FIELDS
    for name in FIELDS:
        assert _same(d[name], DEFAULTS[name]), name
        assert _same(getattr(p, name), DEFAULTS[name]), name
    # Every property of the class is a field (no stale getter for a removed field).
    props = {n for n, v in vars(kt.CodecParams).items() if inspect.isdatadescriptor(v)}
    assert props == set(FIELDS)


def test_stub_signature_and_properties_match_core_defaults():
    args = _stub_constructor()
    assert [a.arg for a in args.kwonlyargs] == FIELDS
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        stub = ast.literal_eval(d)
        assert _same(stub, DEFAULTS[a.arg]), (a.arg, stub, DEFAULTS[a.arg])
    props = [
        n.name
        for n in _stub_members(ast.FunctionDef)
        if any(isinstance(d, ast.Name) and d.id == "property" for d in n.decorator_list)
    ]
    assert props == FIELDS


def test_bench_flags_are_the_fields():
    assert list(bench_cli._PARAM_FLAGS) == FIELDS
    p = argparse.ArgumentParser()
    bench_cli.add_param_flags(p)
    given = {a.dest for a in p._actions if a.option_strings and a.dest != "help"}
    assert given == set(FIELDS)
    # No flag given: the core's defaults.
    assert bench_cli.params_from_args(p.parse_args([])) == kt.CodecParams()
    args = p.parse_args(
        ["--bit-width", "1", "--centroids=-1,1", "--share-basis", "--rank-cap", "4"]
    )
    got = bench_cli.params_from_args(args)
    assert (got.bit_width, got.centroids) == (1, [-1.0, 1.0])
    assert (got.share_basis, got.rank_cap) == (True, 4)


@pytest.mark.parametrize("name", FIELDS)
def test_every_field_round_trips_through_replace_and_pickle(name):
    p = kt.CodecParams()
    assert p.replace(**{name: DEFAULTS[name]}) == p
    assert pickle.loads(pickle.dumps(p)) == p
