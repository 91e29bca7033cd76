"""Fuzzed user files: cluster files, catalogues, profiles, plans, run specs and job
traces that are malformed in every way hypothesis finds. Each either loads or raises a
UserError that names the field (or file:line); never another exception, never a hang.
In-process and bounded (max_examples), so the whole file runs in seconds."""
import copy
import json
from importlib import resources
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetrain.cluster.spec import load_cluster, parse_cluster
from hetrain.errors import UserError
from hetrain.pipeline.spec import RunSpec
from hetrain.plan.catalogue import load_catalogue, parse_catalogue
from hetrain.plan.profile import ModelProfile, parse_profile
from hetrain.sched.cluster import parse_cluster_spec
from hetrain.sched.trace import load_trace, parse_trace_lines
from tests.helpers import small_cluster

FUZZ = settings(max_examples=int(__import__("os").environ.get("FUZZ_N", 60)), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=True),
                    st.text(max_size=12), st.sampled_from(["", "1", "-1", "0", "1e309", "nan", "4GiB", "10gbit",
                                                           "worker", "cpu", "gpu", "abc"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)


def paths(doc, prefix=()):
    """Every path into a nested document (dict keys, list indices)."""
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from paths(v, prefix + (i,))


@st.composite
def mutated(draw, valid):
    """A valid document with one change: a value replaced by junk, a key dropped, or an
    unknown key added. Returns (document, path of the change)."""
    doc = copy.deepcopy(valid)
    candidates = [p for p in paths(doc) if p]
    path = draw(st.sampled_from(candidates))
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    how = draw(st.sampled_from(["replace", "drop", "extra"]))
    if how == "replace" or (how == "drop" and isinstance(parent, list)):
        parent[path[-1]] = draw(values)
    elif how == "drop":
        del parent[path[-1]]
    else:
        inside = isinstance(parent[path[-1]], dict)
        target = parent[path[-1]] if inside else parent
        if isinstance(target, dict):
            key = draw(st.text(min_size=1, max_size=8))
            target[key] = draw(values)
            path = (path if inside else path[:-1]) + (key,)
        else:
            parent[path[-1]] = draw(values)
    return doc, path


def names_the_place(message: str, path: tuple) -> bool:
    """The error points at the change: one of the path's keys, or its dotted location."""
    keys = [str(k) for k in path]
    return any(k and k in message for k in keys) or "unknown key" in message or "required" in message


def check(load, doc, path=None):
    """Load `doc`: fine, or a UserError naming the place. Anything else fails the test."""
    try:
        load(doc)
    except UserError as err:
        msg = str(err)
        assert msg.strip(), "empty error message"
        assert "Traceback" not in msg
        if path is not None:
            assert names_the_place(msg, path), f"error does not name {path}: {msg}"


# ---- cluster files -------------------------------------------------------------------------
CLUSTER = small_cluster(workers=3, cpus=1, emulate="none", latency_ms=0)


@FUZZ
@given(mutated(CLUSTER))
def test_fuzzed_cluster_files(case):
    doc, path = case
    check(lambda d: parse_cluster(d, "c.yaml"), doc, path)


@FUZZ
@given(values)
def test_arbitrary_documents_as_cluster_files(doc):
    check(lambda d: parse_cluster(d, "c.yaml"), doc)


@FUZZ
@given(st.text(max_size=200))
def test_arbitrary_text_as_cluster_file(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    try:
        load_cluster(p)
    except UserError as err:
        assert "c.yaml" in str(err)


def test_cluster_file_with_binary_garbage(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_bytes(b"\xff\xfe\x00machines: [\x80\x81")
    with pytest.raises(UserError, match="c.yaml"):
        load_cluster(p)


# ---- catalogues ----------------------------------------------------------------------------
CATALOGUE = yaml.safe_load(resources.files("hetrain.data").joinpath("catalogue_aws.yaml").read_text())


@FUZZ
@given(mutated(CATALOGUE))
def test_fuzzed_catalogues(case):
    doc, path = case
    check(lambda d: parse_catalogue(d, "cat.yaml"), doc, path)


@FUZZ
@given(st.text(max_size=200))
def test_arbitrary_text_as_catalogue(tmp_path, text):
    p = tmp_path / "cat.yaml"
    p.write_text(text)
    try:
        load_catalogue(p)
    except UserError as err:
        assert "cat.yaml" in str(err)


# ---- profiles ------------------------------------------------------------------------------
PROFILE = {"model": "m", "batch": 8, "layers": [
    {"name": "l0", "kind": "dense", "time_s": 1e-4, "act_bytes": 256, "stored_act_bytes": 256,
     "dense_param_bytes": 1024, "sparse_param_bytes": 0},
    {"name": "l1", "kind": "sparse", "time_s": 2e-4, "act_bytes": 64, "stored_act_bytes": 64,
     "dense_param_bytes": 0, "sparse_param_bytes": 4096}],
    "measured": {"p3.2xlarge": [1e-5, 2e-5]}}


@FUZZ
@given(mutated(PROFILE))
def test_fuzzed_profiles(case):
    doc, path = case
    check(lambda d: parse_profile(d, "p.json"), doc, path)


@FUZZ
@given(st.text(max_size=200))
def test_arbitrary_text_as_profile(tmp_path, text):
    p = tmp_path / "p.json"
    p.write_text(text)
    try:
        ModelProfile.load(p)
    except UserError as err:
        assert "p.json" in str(err)


# ---- plans and run specs ---------------------------------------------------------------------
PLAN = {"format": "hetrain.plan/1", "model": "ctr-small", "feasible": True, "target": 100.0, "batch_size": 256,
        "stages": [{"layers": [0, 5], "type": "cpu", "kind": "cpu", "instances": 1},
                   {"layers": [5, 11], "type": "gpu-k80", "kind": "gpu", "instances": 2},
                   {"layers": [11, 14], "type": "cpu", "kind": "cpu", "instances": 1}]}


@pytest.fixture(scope="module")
def ctr_profile(tmp_path_factory):
    from hetrain.pipeline.workload import emulated_profile

    path = tmp_path_factory.mktemp("profile") / "ctr.json"
    emulated_profile().save(path)
    return path


@FUZZ
@given(mutated(PLAN))
def test_fuzzed_plans(ctr_profile, case):
    from hetrain.pipeline.cli import compile_plan

    doc, path = case
    check(lambda d: compile_plan(d, profile_path=str(ctr_profile)), doc, path)


@FUZZ
@given(values)
def test_arbitrary_documents_as_plans(tmp_path, doc):
    from hetrain.plan.render import load_plan

    p = tmp_path / "plan.json"
    p.write_text(json.dumps(doc))
    check(lambda _: load_plan(p), doc)


@pytest.fixture(scope="module")
def spec_doc(ctr_profile):
    from hetrain.pipeline.cli import compile_plan

    spec, _, _ = compile_plan(copy.deepcopy(PLAN), profile_path=str(ctr_profile))
    return json.loads(spec.to_json())


@FUZZ
@given(data=st.data())
def test_fuzzed_run_specs(tmp_path, spec_doc, data):
    doc, path = data.draw(mutated(spec_doc))
    p = tmp_path / "spec.json"
    p.write_text(json.dumps(doc))
    check(lambda _: RunSpec.load(p), doc, path)


# ---- job traces ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def throughputs(tmp_path_factory):
    """A small throughput table in Gavel's format: two job types on two GPU types."""
    table = {g: {f"('{jt}', {n})": {"null": rate * n ** 0.8} for jt, rate in (("A3C", 2.0), ("LM", 1.0))
                 for n in (1, 2, 4)} for g in ("v100", "k80")}
    path = tmp_path_factory.mktemp("gavel") / "simulation_throughputs.json"
    path.write_text(json.dumps(table))
    return str(path)


field_text = st.one_of(st.text(max_size=8), st.sampled_from(["A3C", "LM", "1", "0", "-3", "1e9", "inf", "nan", "2.5",
                                                            " 4 ", "", "\t", "1" * 40]))


@FUZZ
@given(lines=st.lists(st.one_of(
    st.lists(field_text, min_size=0, max_size=9).map("\t".join),
    st.tuples(st.sampled_from(["A3C", "LM", "X"]), st.just("cmd"), st.just("-n"), st.just("1"), field_text,
              field_text, field_text).map("\t".join),
    st.text(max_size=30)), min_size=0, max_size=6))
def test_fuzzed_traces(throughputs, lines):
    cluster = parse_cluster_spec("v100:4,k80:4")
    try:
        parse_trace_lines([line + "\n" for line in lines], cluster, source="t.trace", throughputs=throughputs)
    except UserError as err:
        msg = str(err)
        assert msg.startswith("t.trace"), msg  # t.trace:LINE: ... (or t.trace: no jobs)


def test_trace_file_with_binary_garbage(tmp_path, throughputs):
    p = tmp_path / "t.trace"
    p.write_bytes(b"A3C\tcmd\t-n\t1\t\xff\xfe\t1\t1\n")
    with pytest.raises(UserError, match="t.trace"):
        load_trace(p, parse_cluster_spec("v100:4"), throughputs=throughputs)


def test_binary_garbage_in_every_structured_file(tmp_path):
    from hetrain.plan.render import load_plan

    for name, load in (("c.yaml", load_cluster), ("cat.yaml", load_catalogue), ("p.json", ModelProfile.load),
                       ("plan.json", load_plan)):
        p = tmp_path / name
        p.write_bytes(b"\x00\xff\xfe garbage \x80")
        with pytest.raises(UserError, match=name):
            load(p)


def test_fuzz_examples_are_valid_to_start_with(ctr_profile):
    from hetrain.pipeline.cli import compile_plan

    parse_cluster(CLUSTER)
    parse_catalogue(CATALOGUE)
    parse_profile(PROFILE)
    compile_plan(copy.deepcopy(PLAN), profile_path=str(ctr_profile))
    assert Path(ctr_profile).is_file()
