"""ORTModuleOptions against the environment it is applied to: explicit values that ORT would ignore given a variable
already exported (a job script's ORTMODULE_MEMORY_OPT_LEVEL=1 plus recompute_plans here) are errors at apply(), wrap()
and `with`, naming both sides; apply() is all or nothing; and, over generated option values and environments, every
combination either applies completely or raises naming the field, with os.environ unchanged after a failure."""

import os
import re
import sys
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_options import ORTModuleOptions, options  # the module under test, loaded with or without torch

VARS = {v.field: v.env for v in options.TABLE}


@pytest.fixture(autouse=True)
def clean_ortmodule_env(monkeypatch):
    """No ORTMODULE_* variable at the start; the environment restored afterwards. ORT counts as not loaded yet."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("ORTMODULE_")}
    for name in saved:
        del os.environ[name]
    for marker in options._READ_MARKERS.values():
        if marker is not None:
            monkeypatch.delitem(sys.modules, marker, raising=False)
    monkeypatch.setattr(options, "_WRAPPED", False)
    yield
    for name in [k for k in os.environ if k.startswith("ORTMODULE_")]:
        del os.environ[name]
    os.environ.update(saved)


def ortmodule_env():
    return {k: v for k, v in os.environ.items() if k.startswith("ORTMODULE_")}


# environment, options given here, fragments of the error (both sides named)
ENV_CONFLICTS = [
    ({"ORTMODULE_MEMORY_OPT_LEVEL": "1"}, dict(recompute_plans=["Gelu+:1:-1"]),
     ["recompute_plans (ORTMODULE_MEMORY_OPT_CONFIG) = Gelu+:1:-1 given here conflicts with "
      "ORTMODULE_MEMORY_OPT_LEVEL='1' in the environment (memory_opt_level = 1)",
      "ORT ignores the plan file at levels 1 and 2", "Set memory_opt_level here", "or unset ORTMODULE_MEMORY_OPT_LEVEL"]),
    ({"ORTMODULE_MEMORY_OPT_LEVEL": "2"}, dict(recompute_plans=["Gelu+:1:-1"], log_level="INFO"),
     ["ORTMODULE_MEMORY_OPT_LEVEL='2' in the environment"]),
    ({"ORTMODULE_ENABLE_COMPUTE_OPTIMIZER": "0"}, dict(embedding_sparse_optimizer=True),
     ["embedding_sparse_optimizer (ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER) = 1 given here conflicts with "
      "ORTMODULE_ENABLE_COMPUTE_OPTIMIZER='0'", "turns the embedding sparse optimizer off"]),
    ({"ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER": "1"}, dict(compute_optimizer=False),
     ["compute_optimizer (ORTMODULE_ENABLE_COMPUTE_OPTIMIZER) = 0 given here conflicts with "
      "ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER='1'"]),
    ({"ORTMODULE_ENABLE_CUSTOM_AUTOGRAD": "false"}, dict(mem_efficient_grad_mgmt=True),
     ["ORTMODULE_ENABLE_CUSTOM_AUTOGRAD='false' in the environment", "custom autograd support is off"]),
    ({"ORTMODULE_MEMORY_OPT_LEVEL": "one"}, dict(recompute_plans=["Gelu+:1:-1"]),
     ["recompute_plans (ORTMODULE_MEMORY_OPT_CONFIG) = Gelu+:1:-1 given here depends on "
      "ORTMODULE_MEMORY_OPT_LEVEL='one' in the environment, which ORT cannot read as meant",
      "memory_opt_level (ORTMODULE_MEMORY_OPT_LEVEL): got 'one'"]),
]


def _apply(opts):
    opts.apply()


def _with(opts):
    with opts:
        pytest.fail("entered the block")


def _wrap(opts):
    options.wrap(object(), opts)  # apply() runs before ORTModule is imported or constructed


@pytest.mark.parametrize("how", [_apply, _with, _wrap], ids=["apply", "with", "wrap"])
@pytest.mark.parametrize("env, given_, fragments", ENV_CONFLICTS, ids=[str(c[1])[:50] for c in ENV_CONFLICTS])
def test_explicit_value_that_the_environment_makes_ort_ignore_is_an_error(how, env, given_, fragments):
    os.environ.update(env)
    opts = ORTModuleOptions(**given_)  # fine on its own
    before = ortmodule_env()
    with pytest.raises(ValueError) as info:
        how(opts)
    for fragment in fragments:
        assert fragment in str(info.value)
    assert ortmodule_env() == before
    assert opts._saved == []  # `with` saved nothing it would restore later


@pytest.mark.parametrize("env, given_", [
    ({"ORTMODULE_MEMORY_OPT_LEVEL": "0"}, dict(recompute_plans=["Gelu+:1:-1"])),
    ({"ORTMODULE_MEMORY_OPT_LEVEL": "1"}, dict(recompute_plans=["Gelu+:1:-1"], memory_opt_level=0)),  # replaced here
    ({"ORTMODULE_MEMORY_OPT_LEVEL": "1"}, dict(recompute_plans=[])),
    ({"ORTMODULE_ENABLE_COMPUTE_OPTIMIZER": "1"}, dict(label_sparse_optimizer=True)),
    ({"ORTMODULE_MEMORY_OPT_LEVEL": "nonsense"}, dict(log_level="INFO")),  # unrelated: check_environment's business
])
def test_compatible_environment_applies(env, given_):
    os.environ.update(env)
    written = ORTModuleOptions(**given_).apply()
    assert ortmodule_env() == {**env, **written}


def test_apply_is_all_or_nothing_when_writing_fails_halfway(monkeypatch):
    os.environ["ORTMODULE_LOG_LEVEL"] = "ERROR"
    opts = ORTModuleOptions(memory_opt_level=1, log_level="INFO", onnx_opset_version=17)
    environ_class = type(os.environ)
    original = environ_class.__setitem__

    def failing(self, key, value):
        if key == "ORTMODULE_ONNX_OPSET_VERSION":
            raise OSError("simulated failure while writing the environment")
        original(self, key, value)

    monkeypatch.setattr(environ_class, "__setitem__", failing)
    with pytest.raises(OSError, match="simulated"):
        opts.apply()
    monkeypatch.setattr(environ_class, "__setitem__", original)
    assert ortmodule_env() == {"ORTMODULE_LOG_LEVEL": "ERROR"}  # the two earlier variables were put back


def test_paths_are_checked_again_at_apply(tmp_path):
    target = tmp_path / "cache"
    opts = ORTModuleOptions(cache_dir=str(target / "onnx"), log_level="INFO")
    target.write_text("now a file")  # the path can no longer be created
    with pytest.raises(ValueError, match=re.escape(f"cache_dir (ORTMODULE_CACHE_DIR): {str(target / 'onnx')!r} cannot "
                                                   f"be created: {str(target)!r} is not a directory")):
        opts.apply()
    assert ortmodule_env() == {}


# ---- properties --------------------------------------------------------------------------------------------------------

_DIR = tempfile.TemporaryDirectory(prefix="ort_optim_props_")
EXISTING_DIR = _DIR.name
A_FILE = os.path.abspath(__file__)

# Values for a few fields that take part in conflicts, or touch the file system, good and bad.
FIELD_VALUES = {
    "memory_opt_level": st.sampled_from([0, 1, 2, 3, "1", True, None]),
    "recompute_plans": st.sampled_from([["Gelu+:1:-1"], [], "BiasGelu+:1:-1,Gelu+:2:3", ["Gelu:1:-1"], None]),
    "compute_optimizer": st.sampled_from([True, False, "0", "maybe", None]),
    "embedding_sparse_optimizer": st.sampled_from([True, False, None]),
    "label_sparse_optimizer": st.sampled_from([True, "1", 2, None]),
    "custom_autograd": st.sampled_from([True, False, None]),
    "mem_efficient_grad_mgmt": st.sampled_from([True, False, None]),
    "log_level": st.sampled_from(["info", "LOUD", None]),
    "save_onnx_path": st.sampled_from([EXISTING_DIR, A_FILE, "/nonexistent/x", EXISTING_DIR + "\0", None]),
    "cache_dir": st.sampled_from([EXISTING_DIR + "/new/dir", A_FILE + "/x", "", None]),
}
# Raw environment values for the variables of those fields.
ENV_VALUES = st.sampled_from(["0", "1", "2", "true", "False", "INFO", "info", "abc", " ", EXISTING_DIR])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                     HealthCheck.too_slow])
@given(st.fixed_dictionaries({}, optional=FIELD_VALUES),
       st.dictionaries(st.sampled_from([VARS[f] for f in FIELD_VALUES if f != "recompute_plans"]), ENV_VALUES,
                       max_size=4))
def test_property_applies_completely_or_raises_naming_the_field(kwargs, env):
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    for name in [k for k in os.environ if k.startswith("ORTMODULE_")]:
        del os.environ[name]
    os.environ.update(env)
    before = dict(os.environ)
    try:
        opts = ORTModuleOptions(**kwargs)
        written = opts.apply()
    except ValueError as e:
        assert any(f"{field} ({VARS[field]})" in str(e) for field in kwargs), (kwargs, env, str(e))
        assert dict(os.environ) == before
        return
    assert dict(os.environ) == {**before, **written}
    assert set(written) == {VARS[f] for f in kwargs}
    # Nothing given here is ignored by ORT because of the environment: every conflict rule holds on what ORT reads.
    for a, b, conflict, _ in options._CONFLICTS:
        if a in kwargs or b in kwargs:
            values = []
            for field in (a, b):
                raw = os.environ.get(VARS[field])
                values.append(None if raw is None else options._BY_FIELD[field].parse_env(raw))
            assert None in values or not conflict(*values), (a, b, values)
