"""ort_optim.options, as a specification: the table of ORTModule environment variables and everything generated from
it (validation, reading the environment, the plan file, apply() and its context manager, describe(),
check_environment(), the command line, the guide's table), and the options against the environment they are applied
to.

* Explicit values that ORT would ignore given a variable already exported (a job script's
  ORTMODULE_MEMORY_OPT_LEVEL=1 plus recompute_plans here) are errors at apply(), wrap() and ``with``, naming both
  sides; apply() is all or nothing; over generated option values and environments (hypothesis), every combination
  either applies completely or raises naming the field, with os.environ unchanged after a failure.

Everything here runs without torch and onnxruntime except test_wrap_runs_an_ortmodule_on_cpu, which needs
onnxruntime-training 1.19.2 with torch 2.4.x and is skipped elsewhere.
"""

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import types
import warnings
from pathlib import Path

import pytest
from conftest import fuzz_examples
from hypothesis import HealthCheck, given, settings, strategies as st

ROOT = Path(__file__).resolve().parents[2]
OPTIONS_PY = ROOT / "ort_optim" / "options.py"
GUIDE = ROOT / "guides" / "ortmodule-options.md"
EXISTING_FILE = str(Path(__file__).resolve())  # any file that exists, for the "existing file" kinds
# ORTMODULE_SAVE_ONNX_PATH must be an existing writable directory (ORT checks os.access(path, W_OK) and does not create
# it): one with a space in its name, removed when the test process exits.
_SAVE_DIR = tempfile.TemporaryDirectory(prefix="ort optim onnx ")
SAVE_DIR = _SAVE_DIR.name


def _load_options():
    """ort_optim.options, and the command that runs its command line."""
    try:
        import ort_optim.options as module

        return module, [sys.executable, "-m", "ort_optim.options"]
    except ImportError:
        # ort_optim/__init__.py imports torch; options.py itself needs neither torch nor onnxruntime, so without
        # torch load the file on its own (and run its command line as a script).
        spec = importlib.util.spec_from_file_location("ort_optim_options_standalone", OPTIONS_PY)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module, [sys.executable, str(OPTIONS_PY)]


options, CLI = _load_options()
ORTModuleOptions = options.ORTModuleOptions
OptionsTooLateWarning = options.OptionsTooLateWarning
BY_FIELD = {v.field: v for v in options.TABLE}
BY_ENV = {v.env: v for v in options.TABLE}

ORT_SKIP = "onnxruntime-training's ORTModule needs torch 2.4.x; not installed in this environment"

MEMORY_FIRST = [
    "ORTMODULE_MEMORY_OPT_LEVEL",
    "ORTMODULE_MEMORY_OPT_CONFIG",
    "ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER",
    "ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER",
    "ORTMODULE_ENABLE_MEM_EFFICIENT_GRAD_MGMT",
    "ORTMODULE_DEEPCOPY_BEFORE_MODEL_EXPORT",
    "ORTMODULE_PRINT_MEMORY_STATS",
]
# Every variable onnxruntime-training 1.19.2 reads (grepped from the wheel, see test_table_matches_installed_ort).
ALL_VARIABLES = MEMORY_FIRST + [
    "ORTMODULE_PRINT_INPUT_DENSITY",
    "ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT",
    "ORTMODULE_ENABLE_COMPUTE_OPTIMIZER",
    "ORTMODULE_ENABLE_CUSTOM_AUTOGRAD",
    "ORTMODULE_FALLBACK_POLICY",
    "ORTMODULE_FALLBACK_RETRY",
    "ORTMODULE_LOG_LEVEL",
    "ORTMODULE_ONNX_OPSET_VERSION",
    "ORTMODULE_SAVE_ONNX_PATH",
    "ORTMODULE_CACHE_DIR",
    "ORTMODULE_USE_EFFICIENT_ATTENTION",
    "ORTMODULE_ATEN_SDPA_FALLBACK",
    "ORTMODULE_ENABLE_ZERO_STAGE3",
    "ORTMODULE_CONV_ALGO_SEARCH",
    "ORTMODULE_SKIPCHECK_POLICY",
    "ORTMODULE_JSON_CONFIG_PATH",
    "ORTMODULE_USE_TRITON",
    "ORTMODULE_TRITON_CONFIG_FILE",
    "ORTMODULE_TRITON_DEBUG",
    "ORTMODULE_USE_FLASH_ATTENTION",
    "ORTMODULE_ENABLE_TUNING",
    "ORTMODULE_MAX_TUNING_DURATION_MS",
    "ORTMODULE_TUNING_RESULTS_PATH",
]
# ORTMODULE_* names in ORT's source that are module constants or comments, not environment variables it reads.
NOT_READ_FROM_ENV = {
    "ORTMODULE_IS_DETERMINISTIC",
    "ORTMODULE_LOG_LEVEL_MAP",
    "ORTMODULE_ONNX_EXPORT_CONTEXT",
    "ORTMODULE_TORCH_CPP_DIR",
    "ORTMODULE_EXTERNAL_TORCH_CPP_EXTENSION_DIR",  # only named in a TODO
    "ORTMODULE_EXTERNAL_TORCH_CUDA_EXTENSION_DIR",  # only named in a TODO
}

# A plan file whose only plan starts with a space, which ORT 1.19.2 reads verbatim (it recomputes nothing).
PLANS_WITH_A_LEADING_SPACE = os.path.join(_SAVE_DIR.name, "plans with a leading space.json")
with open(PLANS_WITH_A_LEADING_SPACE, "w", encoding="utf-8") as _f:
    json.dump([" Gelu+:1:-1"], _f)

PLAN_FILE = object()  # expected text for ORTMODULE_MEMORY_OPT_CONFIG: the path of a plan file

# field, value given, value stored, text written for ORT
GOOD = [
    ("memory_opt_level", 0, 0, "0"),
    ("memory_opt_level", 2, 2, "2"),
    ("memory_opt_level", "1", 1, "1"),
    ("recompute_plans", ["BiasGelu+:1:-1"], ("BiasGelu+:1:-1",), PLAN_FILE),
    ("recompute_plans", "FusedMatMul+Add+:1:-1,Gelu+:2:3", ("FusedMatMul+Add+:1:-1", "Gelu+:2:3"), PLAN_FILE),
    ("recompute_plans", [" LayerNormalization+:0:0 ", "Gelu+:1:05"], ("LayerNormalization+:0:0", "Gelu+:1:5"), PLAN_FILE),
    ("recompute_plans", [], (), PLAN_FILE),
    ("recompute_plans", ["Gelu+:1:2147483647"], ("Gelu+:1:2147483647",), PLAN_FILE),
    ("embedding_sparse_optimizer", True, True, "1"),
    ("label_sparse_optimizer", False, False, "0"),
    ("mem_efficient_grad_mgmt", "true", True, "1"),
    ("deepcopy_before_export", "FALSE", False, "0"),
    ("print_memory_stats", 1, True, "1"),
    ("print_input_density", 0, False, "0"),
    ("allow_autograd_checkpoint", True, True, "1"),
    ("compute_optimizer", False, False, "0"),
    ("custom_autograd", "0", False, "0"),
    ("fallback_policy", "FALLBACK_DISABLE", "FALLBACK_DISABLE", "FALLBACK_DISABLE"),
    ("fallback_policy", ["fallback_force_torch_forward"], "FALLBACK_FORCE_TORCH_FORWARD", "FALLBACK_FORCE_TORCH_FORWARD"),
    ("fallback_retry", True, True, "1"),
    ("fallback_retry", "yes", True, "1"),
    ("log_level", "info", "INFO", "INFO"),
    ("log_level", "VERBOSE", "VERBOSE", "VERBOSE"),
    ("onnx_opset_version", 17, 17, "17"),
    ("onnx_opset_version", "20", 20, "20"),
    ("save_onnx_path", SAVE_DIR, SAVE_DIR, SAVE_DIR),
    ("save_onnx_path", Path(SAVE_DIR), SAVE_DIR, SAVE_DIR),
    ("cache_dir", "/tmp/ort-cache", "/tmp/ort-cache", "/tmp/ort-cache"),  # created by ORT when needed
    ("cache_dir", SAVE_DIR + "/a/b", SAVE_DIR + "/a/b", SAVE_DIR + "/a/b"),
    ("efficient_attention", True, True, "1"),
    ("aten_sdpa_fallback", True, True, "1"),
    ("aten_sdpa_fallback", "TRUE", True, "1"),
    ("zero_stage3", False, False, "0"),
    ("conv_algo_search", "exhaustive", "EXHAUSTIVE", "EXHAUSTIVE"),
    ("skip_check_policy", ["SKIP_CHECK_DEVICE", "skip_check_build_gradient"],
     ("SKIP_CHECK_DEVICE", "SKIP_CHECK_BUILD_GRADIENT"), "SKIP_CHECK_DEVICE|SKIP_CHECK_BUILD_GRADIENT"),
    ("skip_check_policy", "SKIP_CHECK_DISABLED", ("SKIP_CHECK_DISABLED",), "SKIP_CHECK_DISABLED"),
    ("json_config_path", EXISTING_FILE, EXISTING_FILE, EXISTING_FILE),
    ("use_triton", True, True, "1"),
    ("triton_config_file", EXISTING_FILE, EXISTING_FILE, EXISTING_FILE),
    ("triton_debug", True, True, "1"),
    ("flash_attention", False, False, "0"),
    ("enable_tuning", True, True, "1"),
    ("max_tuning_duration_ms", 0, 0, "0"),
    ("max_tuning_duration_ms", 500, 500, "500"),
    ("max_tuning_duration_ms", -1, -1, "-1"),  # ORT ignores values <= 0 (no limit)
    ("tuning_results_path", "/tmp/tuning", "/tmp/tuning", "/tmp/tuning"),
]

# field, bad value, fragment of the error message
BAD = [
    ("memory_opt_level", 3, "got 3"),
    ("memory_opt_level", -1, "got -1"),
    ("memory_opt_level", True, "got True"),
    ("memory_opt_level", 1.0, "got 1.0"),
    ("memory_opt_level", "one", "got 'one'"),
    ("recompute_plans", ["BiasGelu:1:-1"], "cluster 'BiasGelu' must be op type names each followed by '+'"),
    ("recompute_plans", ["+:1:-1"], "cluster '+' must be op type names"),
    ("recompute_plans", ["Bias Gelu+:1:-1"], "cluster 'Bias Gelu+' must be op type names"),
    ("recompute_plans", ["BiasGelu+:3:-1"], "strategy '3' must be 0 (none), 1 (recompute) or 2"),
    ("recompute_plans", ["BiasGelu+:x:-1"], "strategy 'x' must be"),
    ("recompute_plans", ["BiasGelu+:1:-2"], "count '-2' must be an integer >= -1"),
    ("recompute_plans", ["BiasGelu+:1:all"], "count 'all' must be an integer >= -1"),
    # ORT reads the count into a 32-bit int and silently drops a plan whose count does not fit.
    ("recompute_plans", ["BiasGelu+:1:2147483648"], "plan 'BiasGelu+:1:2147483648': count '2147483648' is above "
                                                     "2147483647"),
    ("recompute_plans", ["BiasGelu+:1"], "plan 'BiasGelu+:1' must have three ':'-separated parts"),
    ("recompute_plans", ["BiasGelu+:1:-1:0"], "must have three ':'-separated parts"),
    ("recompute_plans", [42], "plan 42 is not a string"),
    ("recompute_plans", 42, "got 42"),
    ("embedding_sparse_optimizer", "yes", "got 'yes'"),
    ("label_sparse_optimizer", 2, "got 2"),
    ("mem_efficient_grad_mgmt", "on", "got 'on'"),
    ("deepcopy_before_export", "nope", "got 'nope'"),
    ("print_memory_stats", "", "got ''"),
    ("print_input_density", 0.5, "got 0.5"),
    ("allow_autograd_checkpoint", "2", "got '2'"),
    ("compute_optimizer", [], "got []"),
    ("custom_autograd", "enabled", "got 'enabled'"),
    ("fallback_policy", "FALLBACK_NEVER", "got 'FALLBACK_NEVER'"),
    ("fallback_policy", "FALLBACK_DISABLE|FALLBACK_UNSUPPORTED_DATA", "reads exactly one name"),
    ("fallback_policy", ["FALLBACK_DISABLE", "FALLBACK_UNSUPPORTED_DATA"], "got 2 policies"),
    ("fallback_retry", "maybe", "got 'maybe'"),
    ("log_level", "LOUD", "got 'LOUD'"),
    ("log_level", 3, "got 3"),
    ("onnx_opset_version", 6, "got 6"),
    ("onnx_opset_version", 16, "got 16"),  # ORT's training graph fails for LayerNorm below 17
    ("onnx_opset_version", "10", "got '10'"),  # ... and for Linear below 11
    ("onnx_opset_version", 21, "got 21"),
    ("onnx_opset_version", "17.0", "got '17.0'"),
    ("save_onnx_path", "", "got ''"),
    ("save_onnx_path", "/nonexistent/onnx", "no such directory '/nonexistent/onnx' (ORT 1.19.2 checks that it is "
                                            "writable and does not create it)"),
    ("save_onnx_path", EXISTING_FILE, "exists and is not a directory"),
    ("save_onnx_path", SAVE_DIR + "\0x", "holds a NUL byte (an environment variable cannot)"),
    ("cache_dir", EXISTING_FILE + "/cache", f"cannot be created: {EXISTING_FILE!r} is not a directory"),
    ("cache_dir", "/tmp/a\0b", "holds a NUL byte"),
    ("cache_dir", "/tmp/\ud800", "cannot be encoded for the environment"),
    ("json_config_path", EXISTING_FILE + "\0", "holds a NUL byte"),
    ("cache_dir", 3, "got 3"),
    ("efficient_attention", "sometimes", "got 'sometimes'"),
    ("aten_sdpa_fallback", False, "got False, which ORT 1.19.2 would read as ON; leave it unset (None) for off"),
    ("aten_sdpa_fallback", "0", "would read as ON"),
    ("zero_stage3", 3, "got 3"),
    ("conv_algo_search", "FAST", "got 'FAST'"),
    ("skip_check_policy", ["SKIP_CHECK_NOTHING"], "got 'SKIP_CHECK_NOTHING'"),
    ("skip_check_policy", [], "got []"),
    ("json_config_path", "/nonexistent/ortmodule.json", "no such file '/nonexistent/ortmodule.json'"),
    ("use_triton", "y", "got 'y'"),
    ("triton_config_file", "/nonexistent/triton.json", "no such file"),
    ("triton_debug", 7, "got 7"),
    ("flash_attention", "no", "got 'no'"),
    ("enable_tuning", -1, "got -1"),
    ("max_tuning_duration_ms", 1.5, "got 1.5"),
    ("max_tuning_duration_ms", "10ms", "got '10ms'"),
    ("tuning_results_path", "", "got ''"),
    ("tuning_results_path", EXISTING_FILE, "exists and is not a directory"),
]

# variable, text in the environment, value read
ENV_GOOD = [
    ("ORTMODULE_ENABLE_COMPUTE_OPTIMIZER", "0", False),
    ("ORTMODULE_ENABLE_COMPUTE_OPTIMIZER", "1", True),
    ("ORTMODULE_ENABLE_COMPUTE_OPTIMIZER", "TRUE", True),
    ("ORTMODULE_ENABLE_COMPUTE_OPTIMIZER", "False", False),
    ("ORTMODULE_PRINT_MEMORY_STATS", " 1 ", True),
    ("ORTMODULE_FALLBACK_RETRY", "true", True),
    # Each text below is read by ORT 1.19.2 as meant, so it is accepted as ORT reads it.
    ("ORTMODULE_FALLBACK_RETRY", "yes", True),  # value.lower() in ("true", "1", "yes")
    ("ORTMODULE_FALLBACK_RETRY", "YES", True),
    ("ORTMODULE_FALLBACK_RETRY", "no", False),
    ("ORTMODULE_ENABLE_COMPUTE_OPTIMIZER", "01", True),  # int("01") == 1
    ("ORTMODULE_ENABLE_COMPUTE_OPTIMIZER", "+1", True),
    ("ORTMODULE_ENABLE_COMPUTE_OPTIMIZER", "00", False),
    ("ORTMODULE_ENABLE_CUSTOM_AUTOGRAD", "01", True),
    ("ORTMODULE_MAX_TUNING_DURATION_MS", "-1", -1),  # int() reads it; ORT ignores values <= 0
    ("ORTMODULE_ONNX_OPSET_VERSION", "017", 17),
    ("ORTMODULE_ATEN_SDPA_FALLBACK", "1", True),
    ("ORTMODULE_MEMORY_OPT_LEVEL", "2", 2),
    ("ORTMODULE_LOG_LEVEL", "info", "INFO"),
    ("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE", "FALLBACK_DISABLE"),
    ("ORTMODULE_SKIPCHECK_POLICY", "SKIP_CHECK_DEVICE|SKIP_CHECK_EXECUTION_AGENT",
     ("SKIP_CHECK_DEVICE", "SKIP_CHECK_EXECUTION_AGENT")),
    ("ORTMODULE_ONNX_OPSET_VERSION", "17", 17),
    ("ORTMODULE_CACHE_DIR", "/tmp/c", "/tmp/c"),
]

# variable, text in the environment, fragment of the error message
ENV_BAD = [
    ("ORTMODULE_ENABLE_COMPUTE_OPTIMIZER", "yes", "got 'yes'"),
    ("ORTMODULE_ENABLE_COMPUTE_OPTIMIZER", "2", "got '2', which ORT 1.19.2 reads as off (it reads it with "
                                                "int(value) == 1"),
    ("ORTMODULE_ENABLE_CUSTOM_AUTOGRAD", "2", "got '2', which ORT 1.19.2 reads as on (it reads it with int(value) "
                                              "!= 0"),
    ("ORTMODULE_FALLBACK_RETRY", "maybe", "got 'maybe', which ORT 1.19.2 reads as off"),
    ("ORTMODULE_ONNX_OPSET_VERSION", "16", "got '16'"),
    ("ORTMODULE_ENABLE_COMPUTE_OPTIMIZER", "", "empty value; unset the variable instead"),
    ("ORTMODULE_MEMORY_OPT_LEVEL", "1.0", "got '1.0'"),
    ("ORTMODULE_MEMORY_OPT_LEVEL", "  ", "empty value"),
    ("ORTMODULE_LOG_LEVEL", "LOUD", "got 'LOUD'"),
    ("ORTMODULE_ATEN_SDPA_FALLBACK", "0", "would read as ON"),
    ("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE|FALLBACK_UNSUPPORTED_DATA", "reads exactly one name"),
    ("ORTMODULE_SKIPCHECK_POLICY", "SKIP_CHECK_DEVICE|SKIP_CHECK_SOMETHING", "got 'SKIP_CHECK_SOMETHING'"),
    ("ORTMODULE_MEMORY_OPT_CONFIG", "BiasGelu+:1:-1", "inline plans were the format before 1.19"),
    ("ORTMODULE_MEMORY_OPT_CONFIG", "/nonexistent/plans.json", "'/nonexistent/plans.json' is not a readable file"),
    ("ORTMODULE_TRITON_CONFIG_FILE", "/nonexistent/triton.json", "no such file"),
]


@pytest.fixture(autouse=True)
def clean_ortmodule_env():
    """Each test starts with no ORTMODULE_* variable set and leaves the environment as it found it."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("ORTMODULE_")}
    for name in saved:
        del os.environ[name]
    yield
    for name in [k for k in os.environ if k.startswith("ORTMODULE_")]:
        del os.environ[name]
    os.environ.update(saved)


@pytest.fixture
def no_ortmodule_yet(monkeypatch):
    """Pretend ORT has read nothing yet in this process (the ORTModule test may have run before)."""
    for marker in options._READ_MARKERS.values():
        if marker is not None:
            monkeypatch.delitem(sys.modules, marker, raising=False)


def _plans_in(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _expected_error(field, fragment):
    var = BY_FIELD[field]
    return f"{field} ({var.env})", fragment, f"Allowed: {var.kind.allowed}."


# ---------------------------------------------------------------------------------------------------- the table


def test_table_lists_every_variable_memory_first():
    assert [v.env for v in options.TABLE] == ALL_VARIABLES
    assert len({v.field for v in options.TABLE}) == len(options.TABLE)
    for var in options.TABLE:
        assert var.field and var.meaning and var.ort_default and var.kind.allowed
        assert var.read in options._READ_MARKERS


def test_table_matches_installed_ort():
    spec = importlib.util.find_spec("onnxruntime")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("onnxruntime is not installed here; the table is pinned to onnxruntime-training 1.19.2")
    training = Path(list(spec.submodule_search_locations)[0]) / "training"
    if not training.is_dir():
        pytest.skip("this onnxruntime has no training package")
    found = set()
    for path in training.rglob("*.py"):
        found.update(re.findall(r"ORTMODULE_[A-Z0-9_]+", path.read_text(encoding="utf-8", errors="replace")))
    assert found - NOT_READ_FROM_ENV == set(ALL_VARIABLES)


def test_options_py_imports_neither_torch_nor_onnxruntime():
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('opts', {str(OPTIONS_PY)!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['opts'] = m; spec.loader.exec_module(m)\n"
        "bad = [n for n in sys.modules if n.split('.')[0] in ('torch', 'onnxruntime')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_field_has_good_and_bad_cases():
    assert {case[0] for case in GOOD} == set(BY_FIELD)
    assert {case[0] for case in BAD} == set(BY_FIELD)


def test_defaults_are_unset():
    opts = ORTModuleOptions()
    assert all(getattr(opts, v.field) is None for v in options.TABLE)
    assert opts.to_env() == {}
    assert repr(opts) == "ORTModuleOptions()"


def test_fields_are_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        ORTModuleOptions(1)
    opts = ORTModuleOptions(memory_opt_level=1)
    with pytest.raises(AttributeError):
        opts.memory_opt_level = 2


# ---------------------------------------------------------------------------------------------------- validation


def _stable_id(value):
    """A test id without the temporary directory's random name, so that ids are the same in every run."""
    return value.replace(SAVE_DIR, "SAVE_DIR") if isinstance(value, str) else None


@pytest.mark.parametrize("field, given, stored, text", GOOD, ids=_stable_id)
def test_good_value_is_normalized_and_written_for_ort(field, given, stored, text):
    opts = ORTModuleOptions(**{field: given})
    assert getattr(opts, field) == stored
    env = opts.to_env()
    assert list(env) == [BY_FIELD[field].env]
    if text is PLAN_FILE:
        assert _plans_in(env[BY_FIELD[field].env]) == list(stored)
    else:
        assert env[BY_FIELD[field].env] == text
    assert repr(opts) == f"ORTModuleOptions({field}={stored!r})"


@pytest.mark.parametrize("field, bad, fragment", BAD, ids=_stable_id)
def test_bad_value_names_field_variable_and_allowed_values(field, bad, fragment):
    with pytest.raises(ValueError) as info:
        ORTModuleOptions(**{field: bad})
    for part in _expected_error(field, fragment):
        assert part in str(info.value)


def test_exact_error_message():
    with pytest.raises(ValueError) as info:
        ORTModuleOptions(memory_opt_level=3)
    assert str(info.value) == "memory_opt_level (ORTMODULE_MEMORY_OPT_LEVEL): got 3. Allowed: 0, 1, 2."


@pytest.mark.parametrize(
    "given, fragment",
    [
        (dict(memory_opt_level=1, recompute_plans=["Gelu+:1:-1"]), "ORT ignores the plan file at levels 1 and 2"),
        (dict(memory_opt_level=2, recompute_plans=["Gelu+:1:-1"]), "memory_opt_level (ORTMODULE_MEMORY_OPT_LEVEL) = 2"),
        (dict(compute_optimizer=False, embedding_sparse_optimizer=True), "embedding sparse optimizer off"),
        (dict(custom_autograd=False, mem_efficient_grad_mgmt=True), "custom autograd support is off"),
    ],
)
def test_conflicting_fields_raise(given, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        ORTModuleOptions(**given)


@pytest.mark.parametrize(
    "given",
    [
        dict(memory_opt_level=0, recompute_plans=["Gelu+:1:-1"]),
        dict(memory_opt_level=1, recompute_plans=[]),
        dict(compute_optimizer=False, embedding_sparse_optimizer=False, label_sparse_optimizer=False),
        dict(compute_optimizer=False, label_sparse_optimizer=True),  # ORT never uses the label flag: no conflict
        dict(custom_autograd=True, mem_efficient_grad_mgmt=True),
    ],
)
def test_compatible_fields_pass(given):
    ORTModuleOptions(**given)


# ---------------------------------------------------------------------------------------------------- environment


@pytest.mark.parametrize("name, raw, value", ENV_GOOD)
def test_from_env_reads_value(name, raw, value):
    opts = ORTModuleOptions.from_env({name: raw, "PATH": "/bin"})
    assert getattr(opts, BY_ENV[name].field) == value
    assert opts.source(BY_ENV[name].field) == "environment"


@pytest.mark.parametrize("name, raw, fragment", ENV_BAD, ids=_stable_id)
def test_from_env_rejects_value(name, raw, fragment):
    with pytest.raises(ValueError) as info:
        ORTModuleOptions.from_env({name: raw})
    for part in _expected_error(BY_ENV[name].field, fragment):
        assert part in str(info.value)


def test_from_env_defaults_to_os_environ_and_ignores_other_names():
    os.environ["ORTMODULE_MEMORY_OPT_LEVEL"] = "1"
    os.environ["ORTMODULE_NOT_A_VARIABLE"] = "x"  # check_environment reports it; from_env ignores it
    assert ORTModuleOptions.from_env() == ORTModuleOptions(memory_opt_level=1)


def test_from_env_reads_the_plan_file(tmp_path):
    path = tmp_path / "plans.json"
    path.write_text(json.dumps(["BiasGelu+:1:-1", "FusedMatMul+Add+:1:2"]))
    opts = ORTModuleOptions.from_env({"ORTMODULE_MEMORY_OPT_CONFIG": str(path)})
    assert opts.recompute_plans == ("BiasGelu+:1:-1", "FusedMatMul+Add+:1:2")
    assert opts.to_env() == {"ORTMODULE_MEMORY_OPT_CONFIG": str(path)}  # the user's file stays the file ORT reads


@pytest.mark.parametrize("content", [[" BiasGelu+ :1:-1"], ["BiasGelu+:1:05"], ["BiasGelu+:1:-1,Gelu+:2:-1"]])
def test_plan_file_normalised_on_read_is_re_emitted_normalised(tmp_path, content):
    """What ORT reads must be what was validated: a file whose strings were normalised (spaces, leading zeros,
    several plans joined with ',') is replaced by a file holding the normalised plans, one per string."""
    path = tmp_path / "plans.json"
    path.write_text(json.dumps(content))
    opts = ORTModuleOptions.from_env({"ORTMODULE_MEMORY_OPT_CONFIG": str(path)})
    emitted = opts.to_env()["ORTMODULE_MEMORY_OPT_CONFIG"]
    assert emitted != str(path)
    assert _plans_in(emitted) == list(opts.recompute_plans)
    assert all(" " not in plan and "," not in plan for plan in _plans_in(emitted))
    assert json.loads(path.read_text()) == content  # the user's file is left alone


@pytest.mark.parametrize("content, what_ort_does", [
    ([" Gelu+:1:-1"], "ORT matches the cluster ' Gelu+' verbatim against op type names each followed by '+', so "
                      "this plan recomputes nothing"),
    (["Gelu+: 1 : -1"], "raises RuntimeError at the first forward"),
    (["Gelu+:1:-1 "], "raises RuntimeError at the first forward"),
])
def test_check_environment_and_describe_read_plan_strings_verbatim_as_ort_does(tmp_path, content, what_ort_does):
    """ORT strips nothing from a plan string, so a plan file is checked as it stands, not as its stripped text."""
    path = tmp_path / "plans.json"
    path.write_text(json.dumps(content))
    env = {"ORTMODULE_MEMORY_OPT_CONFIG": str(path)}
    [problem] = options.check_environment(env)
    assert f"ORTMODULE_MEMORY_OPT_CONFIG={str(path)!r}: ORT 1.19.2 reads a JSON list" in problem
    assert what_ort_does in problem
    normalised = list(ORTModuleOptions.from_env(env).recompute_plans)
    assert problem.endswith(f"write {json.dumps(normalised)} into the file")
    [row] = [line for line in ORTModuleOptions().describe(env).splitlines() if "OPT_CONFIG" in line]
    assert f"{str(path)!r} (INVALID)" in row


@pytest.mark.parametrize("content", [["Gelu+:1:05"], ["Gelu+:1:-1,BiasGelu+:2:3"], []])
def test_check_environment_accepts_plan_strings_ort_reads_as_meant(tmp_path, content):
    path = tmp_path / "plans.json"
    path.write_text(json.dumps(content))
    assert options.check_environment({"ORTMODULE_MEMORY_OPT_CONFIG": str(path)}) == []


def test_an_empty_plan_variable_is_no_plans_as_ort_reads_it():
    """ORT tests len(path) > 0: an empty ORTMODULE_MEMORY_OPT_CONFIG means no plan file, which level 1 is fine with."""
    os.environ["ORTMODULE_MEMORY_OPT_CONFIG"] = ""
    assert options.check_environment() == []
    assert ORTModuleOptions.from_env().recompute_plans == ()
    assert ORTModuleOptions(memory_opt_level=1).apply() == {"ORTMODULE_MEMORY_OPT_LEVEL": "1"}


def test_a_plan_file_kept_from_from_env_is_read_again_when_emitted(tmp_path):
    """The file from_env() read may be rewritten or removed before apply(): ORT then gets the plans that were
    validated, in a file of our own, and the user's file is left as it is."""
    path = tmp_path / "plans.json"
    path.write_text(json.dumps(["Gelu+:1:-1"]))
    opts = ORTModuleOptions.from_env({"ORTMODULE_MEMORY_OPT_CONFIG": str(path)})
    assert opts.to_env() == {"ORTMODULE_MEMORY_OPT_CONFIG": str(path)}
    path.write_text(json.dumps(["Gelu+: 1 : -1"]))  # rewritten
    written = opts.apply()["ORTMODULE_MEMORY_OPT_CONFIG"]
    assert written != str(path) and _plans_in(written) == ["Gelu+:1:-1"]
    assert json.loads(path.read_text()) == ["Gelu+: 1 : -1"]
    path.unlink()  # removed
    written = opts.apply()["ORTMODULE_MEMORY_OPT_CONFIG"]
    assert written != str(path) and _plans_in(written) == ["Gelu+:1:-1"]
    assert options.check_environment() == []


@pytest.mark.parametrize(
    "content, fragment",
    [("{not json", "is not JSON"), ('{"plans": []}', "holds dict, not a JSON list of plan strings"),
     ('["BiasGelu:1:-1"]', "cluster 'BiasGelu' must be")],
)
def test_from_env_rejects_a_bad_plan_file(tmp_path, content, fragment):
    path = tmp_path / "plans.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=re.escape(fragment)):
        ORTModuleOptions.from_env({"ORTMODULE_MEMORY_OPT_CONFIG": str(path)})


@pytest.mark.parametrize("field, given, stored, text", GOOD, ids=_stable_id)
def test_round_trip_through_the_environment(field, given, stored, text):
    opts = ORTModuleOptions(**{field: given})
    env = opts.to_env()
    back = ORTModuleOptions.from_env(env)
    assert back == opts
    assert back.to_env() == env


def test_round_trip_of_many_fields():
    opts = ORTModuleOptions(
        memory_opt_level=0, recompute_plans=["BiasGelu+:1:-1", "Gelu+:1:-1"], embedding_sparse_optimizer=False,
        deepcopy_before_export=False, compute_optimizer=True, fallback_policy="FALLBACK_DISABLE", log_level="info",
        skip_check_policy=["SKIP_CHECK_DISABLED"], onnx_opset_version=17, aten_sdpa_fallback=True,
    )
    env = opts.to_env()
    assert [name for name in env] == [v.env for v in options.TABLE if getattr(opts, v.field) is not None]
    assert ORTModuleOptions.from_env(env) == opts
    assert ORTModuleOptions.from_env(env).to_env() == env


def test_from_env_normalizes_what_ort_cannot_read():
    env = {"ORTMODULE_ENABLE_COMPUTE_OPTIMIZER": "true", "ORTMODULE_LOG_LEVEL": "info"}
    assert ORTModuleOptions.from_env(env).to_env() == {
        "ORTMODULE_ENABLE_COMPUTE_OPTIMIZER": "1", "ORTMODULE_LOG_LEVEL": "INFO"}


def test_replace_keeps_sources_and_validates():
    opts = ORTModuleOptions.from_env({"ORTMODULE_LOG_LEVEL": "ERROR"})
    new = opts.replace(memory_opt_level=1)
    assert new.source("log_level") == "environment" and new.source("memory_opt_level") == "explicit"
    with pytest.raises(ValueError, match="got 5"):
        opts.replace(memory_opt_level=5)


# ---------------------------------------------------------------------------------------------------- the plan file


def test_plan_file_holds_a_json_list_of_plan_strings():
    opts = ORTModuleOptions(recompute_plans=["BiasGelu+:1:-1", "FusedMatMul+Add+:1:-1"])
    path = opts.to_env()["ORTMODULE_MEMORY_OPT_CONFIG"]
    assert os.path.isabs(path) and path.endswith(".json")
    with open(path, encoding="utf-8") as f:
        assert f.read() == '["BiasGelu+:1:-1", "FusedMatMul+Add+:1:-1"]'


def test_plan_file_is_reused_for_equal_plans_and_rewritten_if_removed():
    a = ORTModuleOptions(recompute_plans=["Gelu+:1:-1"]).to_env()["ORTMODULE_MEMORY_OPT_CONFIG"]
    b = ORTModuleOptions(recompute_plans="Gelu+:1:-1").to_env()["ORTMODULE_MEMORY_OPT_CONFIG"]
    c = ORTModuleOptions(recompute_plans=["Gelu+:2:-1"]).to_env()["ORTMODULE_MEMORY_OPT_CONFIG"]
    assert a == b != c
    os.remove(a)
    assert ORTModuleOptions(recompute_plans=["Gelu+:1:-1"]).to_env()["ORTMODULE_MEMORY_OPT_CONFIG"] == a
    assert _plans_in(a) == ["Gelu+:1:-1"]


def test_plan_file_lives_until_the_process_exits():
    code = (
        "import importlib.util, os, sys\n"
        f"spec = importlib.util.spec_from_file_location('opts', {str(OPTIONS_PY)!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['opts'] = m; spec.loader.exec_module(m)\n"
        "opts = m.ORTModuleOptions(recompute_plans=['BiasGelu+:1:-1'])\n"
        "opts.apply()\n"
        "del opts\n"
        "import gc; gc.collect()\n"
        "path = os.environ['ORTMODULE_MEMORY_OPT_CONFIG']\n"
        "assert os.path.isfile(path)\n"
        "print(path)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    path = out.strip().splitlines()[-1]
    assert path.endswith(".json")
    assert not os.path.exists(path)  # removed by the atexit handler


def test_plan_file_argument_writes_a_file_the_caller_keeps(tmp_path):
    target = tmp_path / "sub" / "plans.json"
    env = ORTModuleOptions(recompute_plans=["Gelu+:1:-1"]).to_env(plan_file=str(target))
    assert env == {"ORTMODULE_MEMORY_OPT_CONFIG": str(target)}
    assert _plans_in(target) == ["Gelu+:1:-1"]
    assert str(target) not in options._PLAN_FILES.values()  # not removed at exit


# ---------------------------------------------------------------------------------------------------- apply


def test_apply_writes_the_explicit_fields_only(no_ortmodule_yet):
    os.environ["ORTMODULE_CACHE_DIR"] = "/tmp/keep"
    env = ORTModuleOptions(memory_opt_level=1, compute_optimizer=False).apply()
    assert env == {"ORTMODULE_MEMORY_OPT_LEVEL": "1", "ORTMODULE_ENABLE_COMPUTE_OPTIMIZER": "0"}
    assert {k: v for k, v in os.environ.items() if k.startswith("ORTMODULE_")} == {
        **env, "ORTMODULE_CACHE_DIR": "/tmp/keep"}


def test_context_manager_restores_set_changed_and_removed_variables(no_ortmodule_yet):
    os.environ["ORTMODULE_LOG_LEVEL"] = "ERROR"  # changed by the options
    os.environ["ORTMODULE_ENABLE_COMPUTE_OPTIMIZER"] = "1"  # changed, then removed inside the block
    os.environ["ORTMODULE_CACHE_DIR"] = "/tmp/a"  # not an option here: left alone
    opts = ORTModuleOptions(memory_opt_level=1, log_level="INFO", compute_optimizer=False)
    with opts as entered:
        assert entered is opts
        assert os.environ["ORTMODULE_MEMORY_OPT_LEVEL"] == "1"  # set: was absent
        assert os.environ["ORTMODULE_LOG_LEVEL"] == "INFO"
        assert os.environ["ORTMODULE_ENABLE_COMPUTE_OPTIMIZER"] == "0"
        del os.environ["ORTMODULE_ENABLE_COMPUTE_OPTIMIZER"]
        os.environ["ORTMODULE_CACHE_DIR"] = "/tmp/b"
    assert "ORTMODULE_MEMORY_OPT_LEVEL" not in os.environ
    assert os.environ["ORTMODULE_LOG_LEVEL"] == "ERROR"
    assert os.environ["ORTMODULE_ENABLE_COMPUTE_OPTIMIZER"] == "1"
    assert os.environ["ORTMODULE_CACHE_DIR"] == "/tmp/b"


def test_context_manager_restores_on_error_and_nests(no_ortmodule_yet):
    outer, inner = ORTModuleOptions(memory_opt_level=1), ORTModuleOptions(memory_opt_level=2, log_level="INFO")
    with pytest.raises(RuntimeError):
        with outer:
            with inner:
                assert os.environ["ORTMODULE_MEMORY_OPT_LEVEL"] == "2"
            assert os.environ["ORTMODULE_MEMORY_OPT_LEVEL"] == "1"
            assert "ORTMODULE_LOG_LEVEL" not in os.environ
            raise RuntimeError
    assert not [k for k in os.environ if k.startswith("ORTMODULE_")]
    with outer:  # the same object can be entered again, and recursively
        with outer:
            pass
        assert os.environ["ORTMODULE_MEMORY_OPT_LEVEL"] == "1"
    assert "ORTMODULE_MEMORY_OPT_LEVEL" not in os.environ


def test_apply_before_ort_read_anything_does_not_warn(no_ortmodule_yet):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ORTModuleOptions(memory_opt_level=1, efficient_attention=True, custom_autograd=False).apply()


# field, value, module whose presence means ORT has read the variable for the last time in this process
LATE = [
    ("efficient_attention", True, "onnxruntime.training.ortmodule"),
    ("aten_sdpa_fallback", True, "onnxruntime.training.ortmodule"),
    ("custom_autograd", False, "onnxruntime.training.ortmodule._custom_autograd_function"),
    ("triton_debug", True, "onnxruntime.training.ort_triton"),
]

# Every module an existing ORTModule implies: ORT imported, an ORTModule constructed (its ATen executor extension and
# custom autograd support loaded), Triton loaded.
ORT_IN_USE = [
    "onnxruntime.training.ortmodule",
    "onnxruntime.training.ortmodule._custom_autograd_function",
    "onnxruntime.training.ortmodule.torch_cpp_extensions.aten_op_executor",
    "onnxruntime.training.ort_triton",
]


@pytest.mark.parametrize("field, value, marker", LATE)
def test_apply_warns_after_ort_read_the_variable(no_ortmodule_yet, monkeypatch, field, value, marker):
    monkeypatch.setitem(sys.modules, marker, types.ModuleType(marker))
    with pytest.warns(OptionsTooLateWarning, match=BY_FIELD[field].env):
        ORTModuleOptions(**{field: value}).apply()
    assert os.environ[BY_FIELD[field].env] == BY_FIELD[field].kind.to_env(value)  # still applied


def test_once_per_process_variables_are_exactly_those_with_a_marker():
    for var in options.TABLE:
        once = var.read in ("import", "first construction", "first Triton use")
        assert (options._READ_MARKERS[var.read] is not None) == once, var.env


@pytest.mark.parametrize("how", ["apply", "with"])
def test_options_read_again_for_every_module_never_warn_once_an_ortmodule_exists(no_ortmodule_yet, monkeypatch,
                                                                                   how):
    """A variable ORT reads in every constructor (or on every module's first forward call) still reaches every
    module constructed later, so writing it is never too late, whatever modules already exist."""
    for marker in ORT_IN_USE:
        monkeypatch.setitem(sys.modules, marker, types.ModuleType(marker))
    os.environ.update(ORTMODULE_ENABLE_COMPUTE_OPTIMIZER="0", ORTMODULE_MEMORY_OPT_LEVEL="0")
    per_module = ORTModuleOptions(compute_optimizer=True, memory_opt_level=1, allow_autograd_checkpoint=True,
                                  log_level="ERROR", save_onnx_path=SAVE_DIR, triton_config_file=EXISTING_FILE)
    assert {BY_FIELD[f].read for f in ("compute_optimizer", "memory_opt_level", "allow_autograd_checkpoint",
                                       "log_level", "triton_config_file")} == {
        "construction", "construction and first forward", "first forward", "DebugOptions()"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if how == "apply":
            per_module.apply()
        else:
            with per_module:
                pass


def test_apply_warns_only_for_changed_once_per_process_variables(no_ortmodule_yet, monkeypatch):
    for marker in ORT_IN_USE[1:]:  # an ORTModule exists, but ORT's import-time reading is left out
        monkeypatch.setitem(sys.modules, marker, types.ModuleType(marker))
    with pytest.warns(OptionsTooLateWarning) as record:
        ORTModuleOptions(memory_opt_level=1, custom_autograd=False, efficient_attention=True).apply()
    assert len(record) == 1
    message = str(record[0].message)
    assert "ORTMODULE_ENABLE_CUSTOM_AUTOGRAD (read once per process, when the first ORTModule is constructed" in message
    assert "ORTMODULE_MEMORY_OPT_LEVEL" not in message  # read again by every module
    assert "ORTMODULE_USE_EFFICIENT_ATTENTION" not in message  # read at import: not imported
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ORTModuleOptions(custom_autograd=False).apply()  # unchanged: nothing to warn about
        ORTModuleOptions(json_config_path=EXISTING_FILE).apply()  # read only by load_from_json()


def test_failed_wrap_without_ortmodule_raises_a_clear_error_and_restores_the_environment(no_ortmodule_yet):
    try:
        importlib.import_module("onnxruntime.training.ortmodule")
    except ImportError:
        pass
    else:
        pytest.skip("ORTModule is importable here; test_failed_wrap_restores_the_environment covers it")
    os.environ["ORTMODULE_LOG_LEVEL"] = "ERROR"
    with pytest.raises(ImportError, match="works with torch 2.4.x"):
        options.wrap(object(), ORTModuleOptions(memory_opt_level=1, log_level="INFO"))
    assert ortmodule_env() == {"ORTMODULE_LOG_LEVEL": "ERROR"}  # as before the call


# ---------------------------------------------------------------------------------------------------- describe


def _describe_rows(text):
    lines = text.splitlines()
    assert lines[0] == "ORTModule options (precedence: explicit > environment > ORT 1.19.2 default)"
    assert re.split(r"\s{2,}", lines[1]) == ["variable", "field", "value", "source"]
    rows = {}
    for line in lines[2:]:
        env, field, value, source = re.split(r"\s{2,}", line)
        assert BY_ENV[env].field == field
        rows[env] = (value, source)
    assert list(rows) == ALL_VARIABLES
    return rows


def test_describe_shows_values_and_sources():
    os.environ["ORTMODULE_LOG_LEVEL"] = "ERROR"
    os.environ["ORTMODULE_MEMORY_OPT_LEVEL"] = "2"  # overridden by the explicit argument
    os.environ["ORTMODULE_CONV_ALGO_SEARCH"] = "fastest"
    opts = ORTModuleOptions(memory_opt_level=1, recompute_plans=[], skip_check_policy="SKIP_CHECK_DISABLED")
    rows = _describe_rows(opts.describe())
    assert rows["ORTMODULE_MEMORY_OPT_LEVEL"] == ("1", "explicit")
    assert rows["ORTMODULE_MEMORY_OPT_CONFIG"] == ("[] (no plans)", "explicit")
    assert rows["ORTMODULE_SKIPCHECK_POLICY"] == ("SKIP_CHECK_DISABLED", "explicit")
    assert rows["ORTMODULE_LOG_LEVEL"] == ("ERROR", "environment")
    assert rows["ORTMODULE_CONV_ALGO_SEARCH"] == ("'fastest' (INVALID)", "environment")
    assert rows["ORTMODULE_ENABLE_COMPUTE_OPTIMIZER"] == ("1", "default")
    assert rows["ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER"] == ("1 (ORT's docs say 0)", "default")
    assert opts.source("log_level") == "environment" and opts.source("cache_dir") == "default"


@pytest.mark.parametrize("raw", ["true", "yes", "2", "1.0"])
def test_describe_marks_an_environment_value_ort_cannot_read_as_invalid(raw):
    env = {"ORTMODULE_ENABLE_COMPUTE_OPTIMIZER": raw}  # ORT reads it with int(value) == 1
    rows = _describe_rows(ORTModuleOptions(log_level="INFO").describe(environ=env))
    assert rows["ORTMODULE_ENABLE_COMPUTE_OPTIMIZER"] == (f"{raw!r} (INVALID)", "environment")
    assert options.check_environment(env)  # the two agree


@pytest.mark.parametrize("name, raw, shown", [
    ("ORTMODULE_ENABLE_COMPUTE_OPTIMIZER", "01", "1"),
    ("ORTMODULE_FALLBACK_RETRY", "yes", "1"),
    ("ORTMODULE_MAX_TUNING_DURATION_MS", "-1", "-1"),
    ("ORTMODULE_ATEN_SDPA_FALLBACK", "on", "1"),
])
def test_describe_shows_what_ort_reads_from_the_environment(name, raw, shown):
    rows = _describe_rows(ORTModuleOptions().describe(environ={name: raw}))
    assert rows[name] == (shown, "environment")


@pytest.mark.parametrize("name", ALL_VARIABLES)
@pytest.mark.parametrize("raw", ["0", "1", "01", "2", "-1", "17", "true", "yes", "INFO", "info", "abc", EXISTING_FILE])
def test_describe_marks_invalid_exactly_what_check_environment_reports(name, raw):
    rows = _describe_rows(ORTModuleOptions().describe(environ={name: raw}))
    assert rows[name][0].endswith("(INVALID)") == bool(options.check_environment({name: raw}))


def test_describe_of_from_env_says_environment():
    env = {"ORTMODULE_ENABLE_COMPUTE_OPTIMIZER": "true", "ORTMODULE_MEMORY_OPT_LEVEL": "1"}
    opts = ORTModuleOptions.from_env(env)
    rows = _describe_rows(opts.describe(environ=env))
    assert rows["ORTMODULE_ENABLE_COMPUTE_OPTIMIZER"] == ("1", "environment")
    assert rows["ORTMODULE_MEMORY_OPT_LEVEL"] == ("1", "environment")
    assert rows["ORTMODULE_LOG_LEVEL"] == ("WARNING", "default")


# ---------------------------------------------------------------------------------------------------- check_environment


@pytest.mark.parametrize(
    "env, fragment",
    [
        ({"ORTMODULE_MEMORY_OPT_LEVLE": "1"}, "ORTMODULE_MEMORY_OPT_LEVLE: unknown variable, onnxruntime-training "
                                              "1.19.2 does not read it; did you mean ORTMODULE_MEMORY_OPT_LEVEL?"),
        ({"ORTMODULE_TORCH_CPP_DIR": "/x"}, "ORTMODULE_TORCH_CPP_DIR: unknown variable"),
        ({"ORTMODULE_ENABLE_COMPUTE_OPTIMIZER": "true"},
         "ORTMODULE_ENABLE_COMPUTE_OPTIMIZER='true': ORT 1.19.2 reads it with int(value) == 1 and raises ValueError "
         "on other text, so it cannot read this as meant (ORT raises ValueError on it); write "
         "ORTMODULE_ENABLE_COMPUTE_OPTIMIZER=1"),
        ({"ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT": "true"}, "(ORT warns and uses off); write "
                                                          "ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT=1"),
        ({"ORTMODULE_LOG_LEVEL": "info"}, "looks the exact upper-case name up and raises KeyError for any other text, "
                                          "so it cannot read this as meant (ORT raises KeyError); write "
                                          "ORTMODULE_LOG_LEVEL=INFO"),
        ({"ORTMODULE_CONV_ALGO_SEARCH": "exhaustive"}, "(ORT warns and uses HEURISTIC); write "
                                                       "ORTMODULE_CONV_ALGO_SEARCH=EXHAUSTIVE"),
        ({"ORTMODULE_SKIPCHECK_POLICY": "skip_check_device"}, "write ORTMODULE_SKIPCHECK_POLICY=SKIP_CHECK_DEVICE"),
        # ORT compares value.lower() without stripping: " 1" and "true " read as off
        ({"ORTMODULE_FALLBACK_RETRY": " 1"}, "ORTMODULE_FALLBACK_RETRY=' 1': ORT 1.19.2 reads it with value.lower() "
                                             "in (true, 1, yes), any other text as off, so it cannot read this as "
                                             "meant (it reads 0); write ORTMODULE_FALLBACK_RETRY=1"),
        ({"ORTMODULE_FALLBACK_RETRY": "true "}, "write ORTMODULE_FALLBACK_RETRY=1"),
        ({"ORTMODULE_MEMORY_OPT_LEVEL": "3"}, "memory_opt_level (ORTMODULE_MEMORY_OPT_LEVEL): got '3'"),
    ],
)
def test_check_environment_reports(env, fragment):
    problems = options.check_environment({**env, "HOME": "/root"})
    assert len(problems) == 1
    assert fragment in problems[0]


def test_check_environment_accepts_what_ort_reads():
    env = {"ORTMODULE_FALLBACK_RETRY": "true",  # ORT reads true/1/yes here
           "ORTMODULE_ENABLE_COMPUTE_OPTIMIZER": "0", "ORTMODULE_LOG_LEVEL": "INFO", "ORTMODULE_ONNX_OPSET_VERSION": "17"}
    assert options.check_environment(env) == []
    assert options.check_environment({}) == []


@pytest.mark.parametrize("name, raw", [
    ("ORTMODULE_FALLBACK_RETRY", "yes"),  # _fallback.py: value.lower() in ["true", "1", "yes"]
    ("ORTMODULE_FALLBACK_RETRY", "Yes"),
    ("ORTMODULE_ENABLE_COMPUTE_OPTIMIZER", "01"),  # int("01") == 1
    ("ORTMODULE_PRINT_MEMORY_STATS", " 0 "),  # int() ignores surrounding spaces
    ("ORTMODULE_ENABLE_CUSTOM_AUTOGRAD", "+1"),
    ("ORTMODULE_MAX_TUNING_DURATION_MS", "-1"),  # int() reads it, and ORT ignores values <= 0
    ("ORTMODULE_MAX_TUNING_DURATION_MS", "0"),
    ("ORTMODULE_MEMORY_OPT_LEVEL", "01"),
    ("ORTMODULE_ATEN_SDPA_FALLBACK", "yes"),  # any non-empty text turns it on
])
def test_check_environment_accepts_every_text_ort_reads_as_meant(name, raw):
    assert options.check_environment({name: raw}) == []
    ORTModuleOptions.from_env({name: raw})  # and from_env() reads it


# variable, text, the value ORT 1.19.2 reads from it: the parser of each kind mirrors the code in ORT that reads the
# variable (options.py _RuntimeOptions, _fallback.py, __init__.py's _defined_from_envvar, _custom_gradient_registry)
ORT_READS = [
    ("ORTMODULE_ENABLE_COMPUTE_OPTIMIZER", "01", True),
    ("ORTMODULE_ENABLE_COMPUTE_OPTIMIZER", " 1\n", True),
    ("ORTMODULE_ENABLE_COMPUTE_OPTIMIZER", "2", False),  # int(value) == 1
    ("ORTMODULE_ENABLE_CUSTOM_AUTOGRAD", "2", True),  # int(value), used as a truth value
    ("ORTMODULE_ENABLE_CUSTOM_AUTOGRAD", "0", False),
    ("ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT", "1", True),
    ("ORTMODULE_FALLBACK_RETRY", "YES", True),
    ("ORTMODULE_FALLBACK_RETRY", " 1", False),  # lower() without strip()
    ("ORTMODULE_FALLBACK_RETRY", "nope", False),
    ("ORTMODULE_ATEN_SDPA_FALLBACK", "0", True),  # any non-empty text
    ("ORTMODULE_MAX_TUNING_DURATION_MS", "-5", -5),
    ("ORTMODULE_SKIPCHECK_POLICY", "SKIP_CHECK_DEVICE|SKIP_CHECK_DEVICE", ("SKIP_CHECK_DEVICE",)),
]
# variable, text ORT cannot read, what ORT does instead
ORT_FAILS = [
    ("ORTMODULE_ENABLE_COMPUTE_OPTIMIZER", "true", "ORT raises ValueError on it"),
    ("ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT", "true", "ORT warns and uses off"),
    ("ORTMODULE_ENABLE_CUSTOM_AUTOGRAD", "false", "ORT warns and uses on"),
    ("ORTMODULE_LOG_LEVEL", "info", "ORT raises KeyError"),
    ("ORTMODULE_CONV_ALGO_SEARCH", "exhaustive", "ORT warns and uses HEURISTIC"),
    ("ORTMODULE_SKIPCHECK_POLICY", "SKIP_CHECK_DEVICE,SKIP_CHECK_BUILD_GRADIENT", "ORT raises KeyError"),
    ("ORTMODULE_ONNX_OPSET_VERSION", "17.0", "ORT raises ValueError on it"),
]


@pytest.mark.parametrize("name, raw, seen", ORT_READS)
def test_each_kind_reads_the_text_exactly_as_ort_does(name, raw, seen):
    assert BY_ENV[name].kind.ort_read(raw) == seen


@pytest.mark.parametrize("name, raw, what_ort_does", ORT_FAILS)
def test_each_kind_says_what_ort_does_with_text_it_cannot_read(name, raw, what_ort_does):
    with pytest.raises(options._Invalid, match=re.escape(what_ort_does)):
        BY_ENV[name].kind.ort_read(raw)


# ---------------------------------------------------------------------------------------------------- command line


def _cli(*args, env=None, cwd=None):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ORTMODULE_")}
    environ["PYTHONPATH"] = str(ROOT) + os.pathsep + environ.get("PYTHONPATH", "")
    environ.update(env or {})
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=environ, cwd=cwd or ROOT)


@pytest.mark.slow
def test_cli_prints_export_lines_in_table_order():
    result = _cli("--log-level", "info", "--memory-opt-level", "1", "--compute-optimizer", "false",
                  "--print-memory-stats")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "export ORTMODULE_MEMORY_OPT_LEVEL=1",
        "export ORTMODULE_PRINT_MEMORY_STATS=1",  # a bare boolean flag turns it on
        "export ORTMODULE_ENABLE_COMPUTE_OPTIMIZER=0",
        "export ORTMODULE_LOG_LEVEL=INFO",
    ]


@pytest.mark.slow
def test_cli_writes_the_plan_file_and_quotes_for_the_shell(tmp_path):
    plan_file = tmp_path / "my plans.json"
    save_dir = tmp_path / "dir with 'quotes'"
    save_dir.mkdir()
    result = _cli("--recompute-plan", "BiasGelu+:1:-1", "--recompute-plan", "FusedMatMul+Add+:1:-1,Gelu+:1:2",
                  "--plan-file", str(plan_file), "--save-onnx-path", str(save_dir))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"export ORTMODULE_MEMORY_OPT_CONFIG='{plan_file}'",
        f"export ORTMODULE_SAVE_ONNX_PATH='{tmp_path}/dir with '\"'\"'quotes'\"'\"''",
    ]
    assert _plans_in(plan_file) == ["BiasGelu+:1:-1", "FusedMatMul+Add+:1:-1", "Gelu+:1:2"]
    assert "wrote 3 recompute plan(s)" in result.stderr


@pytest.mark.slow
def test_cli_default_plan_file_is_kept(tmp_path):
    result = _cli("--recompute-plan", "Gelu+:1:-1", env={"XDG_CACHE_HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    (line,) = result.stdout.splitlines()
    path = line.split("=", 1)[1]
    assert path.startswith(str(tmp_path / "ort_optim"))
    assert _plans_in(path) == ["Gelu+:1:-1"]  # still there after the command exited


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_cli_output_evaluates_in_bash(tmp_path):
    (tmp_path / "a b").mkdir()
    script = (
        f'eval "$({shlex.join(CLI)} --log-level info --save-onnx-path "{tmp_path}/a b" '
        f'--plan-file {tmp_path}/p.json --recompute-plan Gelu+:1:-1)" && '
        'printf "%s\\n" "$ORTMODULE_LOG_LEVEL" "$ORTMODULE_SAVE_ONNX_PATH" "$ORTMODULE_MEMORY_OPT_CONFIG"'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORTMODULE_")}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["INFO", f"{tmp_path}/a b", f"{tmp_path}/p.json"]


@pytest.mark.slow
def test_cli_warns_on_stderr_for_a_setting_ort_fails_with_and_still_exports_it():
    result = _cli("--compute-optimizer", "false", "--no-check")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["export ORTMODULE_ENABLE_COMPUTE_OPTIMIZER=0"]
    assert "# warning: onnxruntime-training 1.19.2 fails with ORTMODULE_ENABLE_COMPUTE_OPTIMIZER=0" in result.stderr


def test_cli_rejects_a_bad_flag_value():
    result = _cli("--memory-opt-level", "3")
    assert result.returncode == 2
    assert "memory_opt_level (ORTMODULE_MEMORY_OPT_LEVEL): got '3'. Allowed: 0, 1, 2." in result.stderr
    assert result.stdout == ""


@pytest.mark.slow
def test_cli_reports_typos_and_values_ort_cannot_read():
    result = _cli("--memory-opt-level", "1",
                  env={"ORTMODULE_MEMORY_OPT_LEVLE": "1", "ORTMODULE_ENABLE_COMPUTE_OPTIMIZER": "true"})
    assert result.returncode == 1
    assert result.stdout.splitlines() == ["export ORTMODULE_MEMORY_OPT_LEVEL=1"]
    assert "# ORTMODULE_MEMORY_OPT_LEVLE: unknown variable" in result.stderr
    assert "did you mean ORTMODULE_MEMORY_OPT_LEVEL?" in result.stderr
    assert "write ORTMODULE_ENABLE_COMPUTE_OPTIMIZER=1" in result.stderr


@pytest.mark.slow
def test_cli_checks_the_environment_as_it_will_be_after_eval():
    bad = {"ORTMODULE_ENABLE_COMPUTE_OPTIMIZER": "true", "ORTMODULE_LOG_LEVEL": "LOUD"}
    assert _cli(env=bad).returncode == 1
    fixed = _cli("--compute-optimizer", "1", "--log-level", "warning", env=bad)
    assert fixed.returncode == 0, fixed.stderr
    assert _cli("--no-check", env=bad).returncode == 0


@pytest.mark.slow
def test_cli_flags_come_from_the_table():
    result = _cli("--help")
    assert result.returncode == 0
    help_text = " ".join(result.stdout.split())
    for var in options.TABLE:
        assert var.cli_flags[-1] == "--" + var.field.replace("_", "-")
        for flag in var.cli_flags:
            assert flag in help_text
        assert var.env in help_text


@pytest.mark.slow
def test_cli_describe_and_markdown():
    result = _cli("--describe", "--memory-opt-level", "1", env={"ORTMODULE_LOG_LEVEL": "ERROR"})
    assert result.returncode == 0, result.stderr
    rows = _describe_rows(result.stdout.rstrip("\n"))
    assert rows["ORTMODULE_MEMORY_OPT_LEVEL"] == ("1", "explicit")
    assert rows["ORTMODULE_LOG_LEVEL"] == ("ERROR", "environment")
    markdown = _cli("--markdown")
    assert markdown.returncode == 0
    assert markdown.stdout == options.markdown_table() + "\n"


# ---------------------------------------------------------------------------------------------------- the guide


def test_markdown_table_has_one_row_per_variable():
    lines = options.markdown_table().splitlines()
    assert len(lines) == 2 + len(options.TABLE)
    for line, var in zip(lines[2:], options.TABLE):
        assert line.startswith(f"| `{var.env}` | `{var.field}` |")
        assert len(re.split(r"(?<!\\)\|", line)) == 9  # 7 cells: every '|' inside a cell is escaped


def test_guide_contains_the_generated_table():
    assert options.markdown_table() in GUIDE.read_text(encoding="utf-8"), (
        "guides/ortmodule-options.md is out of date: paste the output of `python -m ort_optim.options --markdown`"
    )


# ---------------------------------------------------------------------------------------------------- ORTModule


def test_wrap_runs_an_ortmodule_on_cpu():
    torch = pytest.importorskip("torch", reason=ORT_SKIP)
    ortmodule = pytest.importorskip("onnxruntime.training.ortmodule", reason=ORT_SKIP)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    wrapped = options.wrap(model, ORTModuleOptions(memory_opt_level=0, deepcopy_before_export=False))
    assert isinstance(wrapped, ortmodule.ORTModule)
    x = torch.randn(3, 4)
    y = wrapped(x)
    y.square().sum().backward()
    torch.testing.assert_close(y, model(x))
    expected = torch.func.grad(lambda w: (x @ w.T + model.bias).square().sum())(model.weight.detach())
    torch.testing.assert_close(model.weight.grad, expected)
    # ORT read the options when it constructed the module.
    runtime = wrapped._torch_module._execution_manager(True)._runtime_options
    assert runtime.memory_optimization_level == 0 and runtime.deepcopy_before_model_export is False
    # Now that an ORTModule exists, changing a variable ORT reads once per process warns.
    with pytest.warns(OptionsTooLateWarning, match="ORTMODULE_ENABLE_CUSTOM_AUTOGRAD"):
        ORTModuleOptions(custom_autograd=False).apply()


def _ort():
    torch = pytest.importorskip("torch", reason=ORT_SKIP)
    ortmodule = pytest.importorskip("onnxruntime.training.ortmodule", reason=ORT_SKIP)
    return torch, ortmodule


def _runtime_options(module):
    return module._torch_module._execution_manager(True)._runtime_options


def test_a_second_wrap_with_new_values_does_not_warn_and_the_new_module_gets_them():
    torch, _ = _ort()
    first = options.wrap(torch.nn.Linear(2, 2), ORTModuleOptions(deepcopy_before_export=True, memory_opt_level=0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = options.wrap(torch.nn.Linear(2, 2), ORTModuleOptions(deepcopy_before_export=False,
                                                                      memory_opt_level=1))
    assert _runtime_options(first).deepcopy_before_model_export is True
    assert _runtime_options(second).deepcopy_before_model_export is False
    assert _runtime_options(second).memory_optimization_level == 1


def test_failed_wrap_restores_the_environment():
    torch, _ = _ort()
    os.environ["ORTMODULE_ENABLE_COMPUTE_OPTIMIZER"] = "1"
    with pytest.raises(AttributeError):  # ORTModule's constructor raises on a debug_options that is not one
        options.wrap(torch.nn.Linear(2, 2), ORTModuleOptions(memory_opt_level=1, compute_optimizer=False),
                     debug_options="not DebugOptions")
    assert ortmodule_env() == {"ORTMODULE_ENABLE_COMPUTE_OPTIMIZER": "1"}


def test_wrap_gives_a_debug_options_passed_to_it_the_log_level_and_save_path(tmp_path):
    """ORT's DebugOptions reads ORTMODULE_LOG_LEVEL and ORTMODULE_SAVE_ONNX_PATH when it is constructed, and the
    variables beat its arguments; wrap() makes that hold for one constructed before the options were applied."""
    torch, ortmodule = _ort()
    debug = ortmodule.DebugOptions(log_level=ortmodule.LogLevel.INFO, save_onnx=True, onnx_prefix="opts")
    model = torch.nn.Linear(2, 2)
    wrapped = options.wrap(model, ORTModuleOptions(log_level="ERROR", save_onnx_path=str(tmp_path)),
                           debug_options=debug)
    used = wrapped._torch_module._execution_manager(True)._debug_options
    assert used.logging.log_level == ortmodule.LogLevel.ERROR
    assert used.save_onnx_models.path == str(tmp_path)
    assert used.save_onnx and used.onnx_prefix == "opts"
    # The caller's object is left as it was.
    assert debug.logging.log_level == ortmodule.LogLevel.INFO and debug.save_onnx_models.path == os.getcwd()
    wrapped(torch.randn(3, 2)).sum().backward()
    assert sorted(p.name for p in tmp_path.glob("opts_*.onnx"))  # the models went to save_onnx_path


def test_wrap_leaves_a_debug_options_alone_when_the_options_set_neither_log_level_nor_save_path():
    torch, ortmodule = _ort()
    debug = ortmodule.DebugOptions(log_level=ortmodule.LogLevel.ERROR)
    wrapped = options.wrap(torch.nn.Linear(2, 2), ORTModuleOptions(memory_opt_level=0), debug_options=debug)
    assert wrapped._torch_module._execution_manager(True)._debug_options is debug


class _Checkpointed:
    """A model whose forward uses torch.utils.checkpoint, which ORT can export only at memory_opt_level=1 (it then
    runs the region inline and recomputes it itself) or with ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT=1."""

    @staticmethod
    def make(torch):
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

            def forward(self, x):
                # Looked up at call time: ORT replaces torch.utils.checkpoint.checkpoint when it is imported.
                h = torch.utils.checkpoint.checkpoint(lambda t: torch.relu(self.a(t)), x, use_reentrant=True)
                return self.b(h).sum()

        torch.manual_seed(0)
        return Net()


def test_memory_opt_level_is_read_at_construction_and_again_at_the_first_forward():
    assert BY_FIELD["memory_opt_level"].read == "construction and first forward"
    torch, ortmodule = _ort()
    import torch.utils.checkpoint  # noqa: F401

    # Applied with wrap() (the variables stay set): the first forward exports the checkpointed model.
    wrapped = options.wrap(_Checkpointed.make(torch), ORTModuleOptions(memory_opt_level=1,
                                                                       fallback_policy="FALLBACK_DISABLE"))
    wrapped(torch.randn(4, 8)).backward()
    for name in ortmodule_env():
        del os.environ[name]
    # Constructed inside a `with` block but run for the first time after it: the export no longer sees level 1.
    with ORTModuleOptions(memory_opt_level=1, fallback_policy="FALLBACK_DISABLE"):
        late = ortmodule.ORTModule(_Checkpointed.make(torch))
        assert _runtime_options(late).memory_optimization_level == 1  # read at construction
    with pytest.raises(Exception, match="gradient checkpointing"):
        late(torch.randn(4, 8)).backward()


def _model_code_that_bound(checkpoint_function, monkeypatch):
    """A model whose module ran `from torch.utils.checkpoint import checkpoint`: its global holds that function."""
    torch, _ = _ort()
    code = types.ModuleType("model_code_with_checkpoint")
    code.__dict__.update(torch=torch, checkpoint=checkpoint_function)
    exec(
        "class Block(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.l = torch.nn.Linear(8, 8)\n"
        "    def forward(self, x):\n"
        "        return checkpoint(self.l, x, use_reentrant=True).sum()\n",
        code.__dict__,
    )
    monkeypatch.setitem(sys.modules, code.__name__, code)
    return torch.nn.Sequential(code.Block())


def _torchs_own_checkpoint(torch):
    """torch.utils.checkpoint.checkpoint as it was before onnxruntime.training.ortmodule replaced it."""
    import torch.utils.checkpoint

    replacement = torch.utils.checkpoint.checkpoint
    assert replacement.__module__ != "torch.utils.checkpoint"  # ORT replaced it on import
    # (searched through the closures: a wrapper of ORT's replacement may hold it one level further down)
    wrappers = [replacement]
    while wrappers:
        function = wrappers.pop()
        if getattr(function, "__module__", None) == "torch.utils.checkpoint":
            return function
        wrappers += [cell.cell_contents for cell in getattr(function, "__closure__", None) or ()
                     if callable(cell.cell_contents)]
    raise AssertionError("torch's own checkpoint function is not in ORT's replacement")


@pytest.mark.parametrize("how", ["given", "environment"])
def test_wrap_at_level_1_warns_about_a_model_whose_code_bound_torchs_checkpoint_before_ort_replaced_it(how,
                                                                                                      monkeypatch):
    """A warning naming the global and the fix, not an error: holding torch's function is not calling it. Not at
    level 0, nor with allow_autograd_checkpoint (ORT then exports torch's regions as they are), nor once the model's
    code holds ORT's replacement, which level 1 runs inline."""
    torch, _ = _ort()
    model = _model_code_that_bound(_torchs_own_checkpoint(torch), monkeypatch)
    if how == "environment":
        os.environ["ORTMODULE_MEMORY_OPT_LEVEL"] = "1"
    with pytest.warns(options.ORTFailureWarning) as warned:
        assert options.wrap(model, ORTModuleOptions(memory_opt_level=1) if how == "given" else None) is not None
    message = "".join(str(w.message) for w in warned)
    for fragment in ("memory_opt_level (ORTMODULE_MEMORY_OPT_LEVEL) = 1", "model_code_with_checkpoint.checkpoint",
                     "Import onnxruntime.training.ortmodule before the model's code"):
        assert fragment in message
    with warnings.catch_warnings():
        warnings.simplefilter("error", options.ORTFailureWarning)
        assert options.wrap(model, ORTModuleOptions(memory_opt_level=0)) is not None
        assert options.wrap(model, ORTModuleOptions(memory_opt_level=1, allow_autograd_checkpoint=True)) is not None
        sys.modules["model_code_with_checkpoint"].checkpoint = torch.utils.checkpoint.checkpoint
        wrapped = options.wrap(model, ORTModuleOptions(memory_opt_level=1, allow_autograd_checkpoint=False,
                                                       fallback_policy="FALLBACK_DISABLE"))
    wrapped(torch.randn(2, 8)).backward()


def test_variables_read_on_the_first_forward_call_are_marked_so():
    for field in ("memory_opt_level", "allow_autograd_checkpoint", "triton_config_file"):
        assert "first forward" in BY_FIELD[field].read, field


@pytest.mark.parametrize("opset", [17, 20])
def test_the_accepted_opsets_train_linear_layernorm_gelu(opset):
    torch, _ = _ort()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    wrapped = options.wrap(net, ORTModuleOptions(onnx_opset_version=opset, fallback_policy="FALLBACK_DISABLE"))
    x = torch.randn(3, 8)
    y = wrapped(x)
    y.sum().backward()
    torch.testing.assert_close(y, net(x))
    assert _runtime_options(wrapped).onnx_opset_version == opset


# ---- against the environment they are applied to ---------------------------------------------------------------------

VARS = {v.field: v.env for v in options.TABLE}


@pytest.fixture
def ort_not_loaded_yet(monkeypatch):
    """No ORTMODULE_* variable at the start; the environment restored afterwards. ORT counts as not loaded yet."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("ORTMODULE_")}
    for name in saved:
        del os.environ[name]
    for marker in options._READ_MARKERS.values():
        if marker is not None:
            monkeypatch.delitem(sys.modules, marker, raising=False)
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
    # Environment values are read as ORT reads them: 'true' where ORT calls int() is an error, not "on"; 'false'
    # where ORT warns and keeps its default is read as that default (on), not as "off".
    ({"ORTMODULE_ENABLE_COMPUTE_OPTIMIZER": "true"}, dict(embedding_sparse_optimizer=True),
     ["ORTMODULE_ENABLE_COMPUTE_OPTIMIZER='true' in the environment, which ORT cannot read as meant",
      "ORT raises ValueError on it", "write ORTMODULE_ENABLE_COMPUTE_OPTIMIZER=1"]),
    ({"ORTMODULE_ENABLE_CUSTOM_AUTOGRAD": "false"}, dict(mem_efficient_grad_mgmt=True),
     ["ORTMODULE_ENABLE_CUSTOM_AUTOGRAD='false' in the environment, which ORT cannot read as meant",
      "ORT warns and uses on", "write ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0"]),
    # A plan file ORT reads differently from its stripped text (a leading space: the plan matches nothing).
    ({"ORTMODULE_MEMORY_OPT_CONFIG": PLANS_WITH_A_LEADING_SPACE}, dict(memory_opt_level=0),
     ["ORTMODULE_MEMORY_OPT_CONFIG=", "which ORT cannot read as meant",
      "ORT matches the cluster ' Gelu+' verbatim", "recomputes nothing"]),
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


@pytest.mark.usefixtures("ort_not_loaded_yet")
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


@pytest.mark.usefixtures("ort_not_loaded_yet")
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


@pytest.mark.usefixtures("ort_not_loaded_yet")
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


@pytest.mark.usefixtures("ort_not_loaded_yet")
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


@pytest.mark.usefixtures("ort_not_loaded_yet")
@settings(max_examples=fuzz_examples(200), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
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


# ------------------------------------------------------------------------------------ settings ORT 1.19.2 fails with

ORT_FAILURES = {  # options -> (the variable the warning names, how ORTModule fails: the phase that raises, its text)
    "compute optimizer off": (dict(compute_optimizer=False), "ORTMODULE_ENABLE_COMPUTE_OPTIMIZER=0",
                              "forward", "'NoneType' object is not iterable"),
    "embedding sparse optimizer off": (dict(embedding_sparse_optimizer=False),
                                       "ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER=0", "forward",
                                       "'NoneType' object is not iterable"),
    "memory-efficient gradients on": (dict(mem_efficient_grad_mgmt=True), "ORTMODULE_ENABLE_MEM_EFFICIENT_GRAD_MGMT=1",
                                      "forward", "zeros()"),
}


@pytest.mark.parametrize("case", ORT_FAILURES)
def test_apply_warns_for_a_setting_ort_reads_and_then_fails_with(case, no_ortmodule_yet):
    given, named, _, _ = ORT_FAILURES[case]
    with pytest.warns(options.ORTFailureWarning, match=re.escape(named)):
        env = ORTModuleOptions(**given).apply()
    assert named.split("=")[0] in env  # (written all the same: ORT reads it as meant)


def test_apply_does_not_warn_for_a_failing_setting_it_does_not_write(no_ortmodule_yet, monkeypatch):
    monkeypatch.setenv("ORTMODULE_ENABLE_COMPUTE_OPTIMIZER", "0")  # (the environment's own business)
    with warnings.catch_warnings():
        warnings.simplefilter("error", options.ORTFailureWarning)
        ORTModuleOptions().apply()
        ORTModuleOptions(memory_opt_level=1).apply()
        ORTModuleOptions(compute_optimizer=True, embedding_sparse_optimizer=True, mem_efficient_grad_mgmt=False,
                         custom_autograd=False).apply()


@pytest.mark.parametrize("case", ORT_FAILURES)
def test_ortmodule_fails_with_each_setting_the_warning_names(case):
    """What the warning says, checked against ORT itself: the module fails in the phase named, whatever the model."""
    torch, _ = _ort()
    given, _, phase, text = ORT_FAILURES[case]
    torch.manual_seed(0)
    with pytest.warns(options.ORTFailureWarning):
        model = options.wrap(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)),
                             ORTModuleOptions(**given))
    x = torch.randn(3, 4)
    if phase == "forward":
        with pytest.raises(TypeError, match=re.escape(text)):
            model(x)
    else:
        y = model(x)
        with pytest.raises(TypeError, match=re.escape(text)):
            y.sum().backward()


# options, model dtype -> whether ORTModule trains a Linear/LayerNorm/GELU stack with them (the text of the failure)
MODEL_DEPENDENT = [
    (dict(onnx_opset_version=18), "float32", None),
    (dict(onnx_opset_version=18), "float16", "Unrecognized attribute: axes for operator ReduceMean"),
    (dict(onnx_opset_version=17), "float16", None),
    (dict(memory_opt_level=2), "float32", None),
    (dict(memory_opt_level=2), "float16", "two nodes with same node name"),
    (dict(memory_opt_level=1), "float16", None),
]


@pytest.mark.parametrize("given, dtype, failure", MODEL_DEPENDENT,
                         ids=[f"{next(iter(g.items()))}-{d}" for g, d, _ in MODEL_DEPENDENT])
def test_settings_that_fail_fp16_models_only_fail_them_as_the_guide_says(given, dtype, failure):
    torch, _ = _ort()
    torch.manual_seed(0)
    dtype = getattr(torch, dtype)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                              torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                              torch.nn.Linear(16, 3)).to(dtype)
    model = options.wrap(net, ORTModuleOptions(fallback_policy="FALLBACK_DISABLE", **given))

    def train_step():
        model(torch.randn(5, 6, dtype=dtype)).float().square().mean().backward()

    if failure is None:
        train_step()
        assert all(p.grad is not None for p in net.parameters())
    else:
        with pytest.raises(Exception, match=re.escape(failure)):
            train_step()


# skip_check_policy -> whether ORT 1.19.2 then runs its gradient-graph check at every training forward
SKIP_CHECK_POLICIES = {
    "SKIP_CHECK_DISABLED": True,
    "SKIP_CHECK_DEVICE": True,
    "SKIP_CHECK_DEVICE|SKIP_CHECK_EXECUTION_AGENT": True,
    "SKIP_CHECK_BUILD_GRADIENT|SKIP_CHECK_DISABLED": True,
    "SKIP_CHECK_DEVICE|SKIP_CHECK_BUILD_GRADIENT": False,
    "SKIP_CHECK_BUILD_GRADIENT": False,
}


def _net_with(buffer, torch):
    """Linear -> (BatchNorm | times a registered mask | nothing) -> mean square."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.bn = torch.nn.BatchNorm1d(4) if buffer == "batchnorm" else None
            if buffer == "mask":
                self.register_buffer("mask", torch.tril(torch.ones(4, 4))[-1])

        def forward(self, x):
            h = self.lin(x)
            h = self.bn(h) if self.bn is not None else h
            return (h * self.mask if buffer == "mask" else h).square().mean()

    torch.manual_seed(0)
    return Net()


@pytest.mark.parametrize("buffer", ["batchnorm", "mask", "none"])
@pytest.mark.parametrize("policy", list(SKIP_CHECK_POLICIES))
def test_a_skip_check_policy_that_checks_the_gradient_graph_fails_a_model_with_buffers_and_wrap_warns(policy, buffer):
    """ORT's check takes every graph input but the user's for a parameter: a buffer the forward reads passes the first
    step (the export) and fails the second. wrap() warns naming the buffers, and only then; the default policy, and
    any that skips the check, trains every model."""
    torch, _ = _ort()
    checks = SKIP_CHECK_POLICIES[policy]
    fails = checks and buffer != "none"
    net = _net_with(buffer, torch)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        model = options.wrap(net, ORTModuleOptions(skip_check_policy=policy.split("|")))
    ours = [str(w.message) for w in warned if issubclass(w.category, options.ORTFailureWarning)]
    assert bool(ours) == fails, ours
    if fails:
        assert "skip_check_policy (ORTMODULE_SKIPCHECK_POLICY)" in ours[0] and "SKIP_CHECK_BUILD_GRADIENT" in ours[0]
        assert ("bn.running_mean" if buffer == "batchnorm" else "mask") in ours[0]
    x = torch.randn(8, 4)
    model(x).backward()  # the first step exports and trains
    if fails:
        with pytest.raises(AssertionError, match="not exist parameter_names"):
            model(x)
    else:
        model(x).backward()
        model(x).backward()


def test_wrap_does_not_warn_about_buffers_under_the_default_skip_check_policy():
    torch, _ = _ort()
    with warnings.catch_warnings():
        warnings.simplefilter("error", options.ORTFailureWarning)
        model = options.wrap(_net_with("batchnorm", torch), ORTModuleOptions(memory_opt_level=0))
    x = torch.randn(8, 4)
    for _ in range(3):
        model(x).backward()


def test_wrap_warns_about_buffers_under_a_skip_check_policy_set_in_the_environment():
    torch, _ = _ort()
    os.environ["ORTMODULE_SKIPCHECK_POLICY"] = "SKIP_CHECK_DISABLED"
    with pytest.warns(options.ORTFailureWarning, match=r"SKIPCHECK_POLICY\) = SKIP_CHECK_DISABLED"):
        options.wrap(_net_with("mask", torch))


# a mean inside the exported model -> the text of the TypeError ORT 1.19.2's shape inference raises at opset 18 (None:
# it trains): a mean over some dimensions whose input is used again fails, another mean trains
MEANS_AT_OPSET_18 = {
    "x - x.mean(-1, keepdim=True)": (lambda h: h - h.mean(-1, keepdim=True), "has no len()"),  # a LayerNorm's centring
    "x - x.mean(0)": (lambda h: h - h.mean(0), "has no len()"),
    "x * x.mean(-1)[..., None]": (lambda h: h * h.mean(-1).unsqueeze(-1), "has no len()"),
    "x * x.mean()": (lambda h: h * h.mean(), None),
    "x.mean(-1, keepdim=True)": (lambda h: h.mean(-1, keepdim=True), None),
    "x.mean(0)": (lambda h: h.mean(0), None),
    "x.mean(dim=-1)": (lambda h: h.mean(dim=-1), None),
}


@pytest.mark.parametrize("kind", list(MEANS_AT_OPSET_18))
def test_opset_18_fails_a_mean_over_some_dimensions_whose_input_is_used_again_as_the_guide_says(kind):
    torch, _ = _ort()
    mean, failure = MEANS_AT_OPSET_18[kind]

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x):
            return mean(self.linear(x))

    torch.manual_seed(0)
    net = Net()
    model = options.wrap(net, ORTModuleOptions(fallback_policy="FALLBACK_DISABLE", onnx_opset_version=18))
    x = torch.randn(2, 3, 8)
    if failure is None:
        model(x).square().sum().backward()
        assert net.linear.weight.grad is not None
    else:
        with pytest.raises(TypeError, match=re.escape(failure)):
            model(x).square().sum().backward()


# ---------------------------------------------------------------------------------------------------- integers


def test_integers_operator_index_accepts_are_stored_and_written_as_plain_ints():
    """An int subclass (a script's IntEnum) is written as its digits, not as its str() ("Level.LAYERWISE", which ORT
    cannot read); a numpy integer is accepted as the integer it is."""
    import enum

    class Level(int, enum.Enum):
        NONE = 0
        LAYERWISE = 1

    opts = ORTModuleOptions(memory_opt_level=Level.LAYERWISE, max_tuning_duration_ms=Level.NONE)
    assert type(opts.memory_opt_level) is int and opts.memory_opt_level == 1
    assert opts.to_env() == {"ORTMODULE_MEMORY_OPT_LEVEL": "1", "ORTMODULE_MAX_TUNING_DURATION_MS": "0"}
    try:
        import numpy as np
    except ImportError:
        return
    assert ORTModuleOptions(onnx_opset_version=np.int64(18)).to_env() == {"ORTMODULE_ONNX_OPSET_VERSION": "18"}
    with pytest.raises(ValueError, match=r"got (np\.int32\()?3\)?\. Allowed: 0, 1, 2\."):  # (numpy 2's repr)
        ORTModuleOptions(memory_opt_level=np.int32(3))
    with pytest.raises(ValueError, match="memory_opt_level"):
        ORTModuleOptions(memory_opt_level=np.bool_(True))


# ---------------------------------------------------------------------------------------------------- threads


def test_exit_without_enter_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"__exit__\(\) without a matching __enter__\(\)"):
        ORTModuleOptions(memory_opt_level=1).__exit__(None, None, None)


def test_a_block_cannot_be_entered_while_another_thread_has_one_open(no_ortmodule_yet):
    """The variables live in the process-wide environment: two threads' blocks would overwrite and then restore
    each other's values, so the second thread's block is refused and the environment stays the first one's."""
    import threading

    errors = []

    def second_thread():
        try:
            with ORTModuleOptions(memory_opt_level=2):
                pass
        except RuntimeError as e:
            errors.append(str(e))

    with ORTModuleOptions(memory_opt_level=1):
        thread = threading.Thread(target=second_thread)
        thread.start()
        thread.join()
        assert os.environ["ORTMODULE_MEMORY_OPT_LEVEL"] == "1"
    assert errors and "another thread is still open" in errors[0]
    assert "ORTMODULE_MEMORY_OPT_LEVEL" not in os.environ
    thread = threading.Thread(target=second_thread)  # once the block is closed, another thread may open one
    thread.start()
    thread.join()
    assert len(errors) == 1


FORK_WHILE_ANOTHER_THREAD_HAS_A_BLOCK = """
import importlib.util, os, signal, sys, threading
spec = importlib.util.spec_from_file_location("options", sys.argv[1])
options = sys.modules["options"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(options)
entered, release = threading.Event(), threading.Event()
def other_thread():  # (inside a block, and inside the module's lock, at the moment of the fork)
    with options.ORTModuleOptions(memory_opt_level=1):
        with options._OPEN_BLOCKS_LOCK:
            entered.set()
            release.wait()
thread = threading.Thread(target=other_thread)
thread.start()
entered.wait()
pid = os.fork()
if pid == 0:
    signal.alarm(20)  # (a child that waits for a lock held by a thread it does not have ends here)
    inherited = os.environ.get("ORTMODULE_MEMORY_OPT_LEVEL")
    with options.ORTModuleOptions(memory_opt_level=2):
        inside = os.environ.get("ORTMODULE_MEMORY_OPT_LEVEL")
    after = os.environ.get("ORTMODULE_MEMORY_OPT_LEVEL")
    os._exit(0 if (inherited, inside, after) == ("1", "2", "1") else 3)
status = os.waitpid(pid, 0)[1]
release.set()
thread.join()
print(status)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is not available on this platform")
def test_a_child_forked_while_another_thread_has_a_block_open_opens_its_own(tmp_path):
    """A forked child has only the thread that forked: the lock another thread of the parent held is made anew, and
    that thread's open block is forgotten (it never closes there; the child's environment keeps its values, as at the
    fork). The child's own blocks open and restore what the child had."""
    script = tmp_path / "fork.py"
    script.write_text(FORK_WHILE_ANOTHER_THREAD_HAS_A_BLOCK)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORTMODULE_")}
    out = subprocess.run([sys.executable, str(script), str(OPTIONS_PY)], capture_output=True, text=True, timeout=60,
                         env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "0", out.stdout  # (14: the child waited for the lock until its alarm)


def test_apply_does_not_warn_too_late_when_ort_reads_the_same_value(no_ortmodule_yet, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime.training.ortmodule._custom_autograd_function", types.ModuleType("m"))
    os.environ["ORTMODULE_ENABLE_CUSTOM_AUTOGRAD"] = "00"  # ORT reads 0, as from the "0" apply() writes
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ORTModuleOptions(custom_autograd=False).apply()
    os.environ["ORTMODULE_ENABLE_CUSTOM_AUTOGRAD"] = "1"
    with pytest.warns(OptionsTooLateWarning, match="ORTMODULE_ENABLE_CUSTOM_AUTOGRAD"):
        ORTModuleOptions(custom_autograd=False).apply()


# ---------------------------------------------------------------------------------------------------- ignored by ORT


def test_label_sparse_optimizer_has_no_effect_in_ort_and_turning_it_off_warns(no_ortmodule_yet):
    """ORT 1.19.2 reads ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER and never uses it (the label sparsity optimization
    follows the embedding flag), so no combination rule rests on it and writing 0 warns that it changes nothing."""
    assert "No effect in ORT 1.19.2" in BY_FIELD["label_sparse_optimizer"].meaning
    assert not [rule for rule in options._CONFLICTS if "label_sparse_optimizer" in rule[:2]]
    with pytest.warns(options.ORTIgnoresWarning, match="ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER=0: ORT 1.19.2 reads "
                                                       "it and never uses it"):
        ORTModuleOptions(label_sparse_optimizer=False).apply()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ORTModuleOptions(label_sparse_optimizer=True).apply()  # ORT's default: nothing to warn about


def test_label_sparse_optimizer_is_read_and_ignored_by_ort():
    torch, _ = _ort()

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 5)
            self.loss = torch.nn.CrossEntropyLoss(ignore_index=-100)

        def forward(self, x, y):
            return self.loss(self.lin(x), y)

    with pytest.warns(options.ORTIgnoresWarning):
        model = options.wrap(Loss(), ORTModuleOptions(label_sparse_optimizer=False, fallback_policy="FALLBACK_DISABLE"))
    y = torch.full((16,), -100)
    y[:2] = 1  # 12.5% label density: below ORT's 90% threshold
    model(torch.randn(16, 8), y).backward()
    runtime = _runtime_options(model)
    assert runtime.enable_label_sparse_optimizer is False  # read ...
    assert runtime.label_sparsity_ratio  # ... and the label optimization ran anyway


@pytest.mark.parametrize("field, value", [("onnx_opset_version", 18), ("allow_autograd_checkpoint", True)])
def test_export_settings_next_to_a_cache_dir_holding_models_warn_that_ort_reuses_them(tmp_path, field, value,
                                                                                        no_ortmodule_yet):
    """ORT names the model it caches in ORTMODULE_CACHE_DIR after str(module) and the rank only, so a later run
    trains the cached export whatever its export settings. (The memory optimizer's level acts on the graph after
    the export, a cached one too: not one of them.)"""
    assert "str(module) and the rank only" in BY_FIELD["cache_dir"].meaning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ORTModuleOptions(cache_dir=str(tmp_path), **{field: value}).apply()  # nothing cached yet
    (tmp_path / "0123abcd_0.onnx").write_bytes(b"")
    with pytest.warns(options.ORTIgnoresWarning, match=re.escape(
            f"{BY_FIELD[field].env} with ORTMODULE_CACHE_DIR={tmp_path}, which holds exported models (0123abcd_0.onnx)"
    )):
        ORTModuleOptions(cache_dir=str(tmp_path), **{field: value}).apply()
    with pytest.warns(options.ORTIgnoresWarning, match="loads them as they are"):
        ORTModuleOptions(**{field: value}).apply()  # the cache dir from the environment
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ORTModuleOptions(cache_dir=str(tmp_path), log_level="INFO").apply()  # not an export setting
        ORTModuleOptions(cache_dir=str(tmp_path), memory_opt_level=0).apply()  # applied after the export
