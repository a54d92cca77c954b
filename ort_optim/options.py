"""ORTModule options: every environment variable onnxruntime-training 1.19.2 reads, declared once.

ORTModule takes almost all of its settings from ``ORTMODULE_*`` environment variables that ORT parses ad hoc
(booleans with ``int(value) == 1``, so ``true`` raises inside ORT; names looked up case-sensitively; the memory
optimizer's plans in a JSON file since 1.19). This module declares each variable once, as a field of
:class:`ORTModuleOptions`, and everything else is generated from that one table: validation, parsing the
environment, writing it, :meth:`ORTModuleOptions.describe`, the command line and the guide's table
(:func:`markdown_table`).

Precedence, highest first:

1. an explicit argument (``ORTModuleOptions(memory_opt_level=1)``), written into ``os.environ`` by ``apply()``;
2. the environment (a variable already set in ``os.environ`` for a field left ``None``);
3. ORT 1.19.2's own default (nothing set anywhere).

Command line (prints ``export`` lines, then checks the current environment for invalid values and typos)::

    python -m ort_optim.options --memory-opt-level 1 --log-level INFO
    eval "$(python -m ort_optim.options --recompute-plan 'BiasGelu+:1:-1')"
    python -m ort_optim.options --describe
    python -m ort_optim.options --markdown        # the table in guides/ortmodule-options.md

This module imports neither torch nor onnxruntime; :func:`wrap` imports ORTModule when it is called.
"""

from __future__ import annotations

import argparse
import atexit
import copy
import dataclasses
import difflib
import functools
import hashlib
import json
import operator
import os
import re
import shlex
import sys
import tempfile
import threading
import warnings
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

ORT_VERSION = "1.19.2"

__all__ = [
    "ORTModuleOptions",
    "OptionsTooLateWarning",
    "ORTFailureWarning",
    "ORTIgnoresWarning",
    "Variable",
    "TABLE",
    "wrap",
    "check_environment",
    "markdown_table",
    "main",
]


class OptionsTooLateWarning(UserWarning):
    """apply() changed a variable that ORT has already read in this process."""


class ORTFailureWarning(UserWarning):
    """apply() set a value that ORT reads as meant but then fails with, whatever the model (_ORT_FAILURES)."""


class ORTIgnoresWarning(UserWarning):
    """apply() set a value that ORT 1.19.2 reads but that has no effect: label_sparse_optimizer off (ORT never uses
    it), or export settings next to a cache_dir that already holds exported models (ORT reuses them as they are)."""


# --------------------------------------------------------------------------------------------------------------
# Kinds: how one variable's value is checked, written for ORT, and read back from the environment.
# --------------------------------------------------------------------------------------------------------------


class _Invalid(Exception):
    """A value a kind cannot accept; Variable turns it into a ValueError naming the field and the variable."""


class _Kind:
    type_name = "str"
    metavar = "VALUE"  # for the command line
    allowed = ""  # shown in the table and at the end of every error message
    ort_parsing = ""  # how ORT itself reads the text, for the environment check

    def parse(self, value: Any) -> Any:
        """A Python value or the text of a variable -> the normalized value."""
        raise NotImplementedError

    def to_env(self, value: Any) -> str:
        return str(value)

    def from_env(self, raw: str) -> Any:
        """The text of a variable -> the value it means: everything ORT reads as meant, and the spellings parse()
        accepts (true/false, lower-case names), which apply() rewrites into what ORT reads."""
        return self.parse(raw)

    def ort_read(self, raw: str) -> Any:
        """The value ORT 1.19.2 itself reads from this text, parsed exactly as ORT parses it; raises _Invalid
        saying what ORT does instead (raises, warns and uses its default) when it cannot read the text."""
        return self.from_env(raw)

    def show(self, value: Any) -> str:
        return self.to_env(value)

    def fix(self, env: str, value: Any) -> str:
        """What to write instead of text ORT cannot read as meant, for the environment check."""
        return f"write {env}={self.to_env(value)}"


def _ort_int(raw: str, failure: str) -> int:
    """int(raw), as ORT calls it: surrounding spaces, a sign, leading zeros and '_' between digits are fine."""
    try:
        return int(raw)
    except ValueError:
        raise _Invalid(failure) from None


class _Bool(_Kind):
    """0/1; true/false (any case) are accepted too, but always written as 1/0.

    ``reading`` says how ORT 1.19.2 reads the variable: "int" (``int(value) == 1``, other text raises inside ORT;
    most variables), "int or off" (``int(value) == 1``, other text warns and means off: ALLOW_AUTOGRAD_CHECKPOINT),
    "int or on" (``int(value) != 0``, other text warns and means on: ENABLE_CUSTOM_AUTOGRAD) or "words"
    (``value.lower() in ("true", "1", "yes")``, any other text means off: FALLBACK_RETRY)."""

    type_name = "bool"
    metavar = "0|1"
    _WORDS = {"0": False, "1": True, "false": False, "true": True}
    _READINGS = {
        "int": "reads it with int(value) == 1 and raises ValueError on other text",
        "int or off": "reads it with int(value) == 1 and, for other text, warns and uses off",
        "int or on": "reads it with int(value) != 0 and, for other text, warns and uses on",
        "words": "reads it with value.lower() in (true, 1, yes), any other text as off",
    }

    def __init__(self, reading: str = "int"):
        assert reading in self._READINGS, reading
        self.reading = reading
        self.ort_parsing = self._READINGS[reading]
        if reading == "words":
            self._WORDS = {**_Bool._WORDS, "no": False, "yes": True}
            self.allowed = "0, 1 (true/false and yes/no accepted, written as 1/0)"
        else:
            self.allowed = "0, 1 (true/false accepted, written as 1/0)"

    def parse(self, value: Any) -> bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in self._WORDS:
            return self._WORDS[value.strip().lower()]
        raise _Invalid(f"got {value!r}")

    def to_env(self, value: bool) -> str:
        return "1" if value else "0"

    def from_env(self, raw: str) -> bool:
        try:
            return self.parse(raw)
        except _Invalid:
            pass
        if self.reading != "words":
            try:
                number = int(raw)
            except ValueError:
                raise _Invalid(f"got {raw!r}") from None
            if number in (0, 1):  # "01", "+1", " 0 ": ORT's int() reads them
                return bool(number)
            seen = "on" if self.ort_read(raw) else "off"
            raise _Invalid(f"got {raw!r}, which ORT {ORT_VERSION} reads as {seen} (it {self.ort_parsing})")
        raise _Invalid(f"got {raw!r}, which ORT {ORT_VERSION} reads as off (it {self.ort_parsing})")

    def ort_read(self, raw: str) -> bool:
        if self.reading == "words":
            return raw.lower() in ("true", "1", "yes")  # (no strip: " 1" reads as off)
        default = {"int": None, "int or off": "off", "int or on": "on"}[self.reading]
        failure = "ORT raises ValueError on it" if default is None else f"ORT warns and uses {default}"
        number = _ort_int(raw, failure)
        return number != 0 if self.reading == "int or on" else number == 1


class _OnIfSet(_Kind):
    """A switch ORT turns on for any non-empty value (``if os.getenv(name):``), even "0"."""

    type_name = "bool"
    metavar = "1"
    allowed = "True / 1 only (ORT turns it on for any non-empty value, even 0; leave it unset for off)"
    ort_parsing = "turns it on for any non-empty value"
    _OFF_WORDS = ("0", "false", "no", "off")

    def parse(self, value: Any) -> bool:
        try:
            on = _Bool().parse(value)
        except _Invalid:
            raise _Invalid(f"got {value!r}") from None
        if not on:
            raise _Invalid(f"got {value!r}, which ORT {ORT_VERSION} would read as ON; leave it unset (None) for off")
        return True

    def to_env(self, value: bool) -> str:
        return "1"

    def from_env(self, raw: str) -> bool:
        # ORT reads any non-empty text as on: so does this, except text that says "off", which ORT also reads as on.
        if raw.strip().lower() in self._OFF_WORDS or re.fullmatch(r"\s*[+-]?0+\s*", raw):
            raise _Invalid(f"got {raw!r}, which ORT {ORT_VERSION} would read as ON; unset the variable for off")
        return True

    def ort_read(self, raw: str) -> bool:
        return bool(raw)


class _Int(_Kind):
    type_name = "int"
    metavar = "INT"
    ort_parsing = "reads it with int(value) and raises ValueError on other text"

    def __init__(self, choices: Optional[Sequence[int]] = None, minimum: Optional[int] = None,
                 maximum: Optional[int] = None, note: str = ""):
        self.choices, self.minimum, self.maximum = choices, minimum, maximum
        if choices is not None:
            self.allowed = ", ".join(str(c) for c in choices)
        elif maximum is not None:
            self.allowed = f"an integer from {minimum} to {maximum}"
        elif minimum is not None:
            self.allowed = f"an integer >= {minimum}"
        else:
            self.allowed = "an integer"
        if note:
            self.allowed += f" ({note})"

    def parse(self, value: Any) -> int:
        """Text as ORT reads it (int()), or any integer operator.index() accepts (an int subclass such as an
        IntEnum member, a numpy integer), stored and written as a plain int: str() of an int subclass can be text
        ORT cannot read ("Level.LAYERWISE"). bool is refused: True is not a level."""
        if isinstance(value, str):
            try:
                number = int(value)  # exactly as ORT reads the variable
            except ValueError:
                raise _Invalid(f"got {value!r}") from None
        elif isinstance(value, bool) or type(value).__name__ in ("bool", "bool_"):  # numpy's bool too
            raise _Invalid(f"got {value!r}")
        else:
            try:
                number = int.__index__(operator.index(value))  # a plain int, even for an int subclass
            except TypeError:
                raise _Invalid(f"got {value!r}") from None
        if self.choices is not None and number not in self.choices:
            raise _Invalid(f"got {value!r}")
        if (self.minimum is not None and number < self.minimum) or (self.maximum is not None and number > self.maximum):
            raise _Invalid(f"got {value!r}")
        return number

    def ort_read(self, raw: str) -> int:
        number = _ort_int(raw, "ORT raises ValueError on it")
        self.parse(number)  # a value ORT reads but cannot use is invalid as well
        return number


class _Choice(_Kind):
    """One name out of a fixed list; accepted in any case, written in ORT's exact (upper) case. ``failure`` says
    what ORT does with any other text."""

    metavar = "NAME"

    def __init__(self, names: Sequence[str], failure: str = "raises KeyError"):
        self.names = tuple(names)
        self.allowed = ", ".join(self.names)
        self.failure = failure
        self.ort_parsing = f"looks the exact upper-case name up and {failure} for any other text"

    def parse(self, value: Any) -> str:
        if not isinstance(value, str) or value.strip().upper() not in self.names:
            raise _Invalid(f"got {value!r}")
        return value.strip().upper()

    def ort_read(self, raw: str) -> str:
        if raw not in self.names:
            raise _Invalid(f"ORT {self.failure}")
        return raw


class _OneFallbackPolicy(_Choice):
    """ORTMODULE_FALLBACK_POLICY: ORT 1.19.2 reads it with ``_FallbackPolicy[value]``, a single member name."""

    def __init__(self, names: Sequence[str]):
        super().__init__(names)
        self.allowed = (
            "one of " + ", ".join(self.names) + f" (a single name: ORT {ORT_VERSION} cannot read a combination)"
        )

    def parse(self, value: Any) -> str:
        if isinstance(value, (list, tuple)):
            if len(value) != 1:
                raise _Invalid(
                    f"got {len(value)} policies {list(value)!r}, but ORT {ORT_VERSION} reads exactly one name"
                )
            value = value[0]
        if isinstance(value, str) and ("|" in value or "," in value):
            raise _Invalid(f"got {value!r}, but ORT {ORT_VERSION} reads exactly one name (_FallbackPolicy[value])")
        return super().parse(value)


class _NameSet(_Kind):
    """Several names out of a fixed list, joined with '|' for ORT (which splits on '|' and looks each name up)."""

    type_name = "list[str]"
    metavar = "NAME|NAME"
    ort_parsing = "splits it on '|', looks up each exact upper-case name and raises KeyError for any other"

    def __init__(self, names: Sequence[str]):
        self.names = tuple(names)
        self.allowed = "one or more of " + ", ".join(self.names) + " ('|'-joined in the variable)"

    def parse(self, value: Any) -> Tuple[str, ...]:
        items = re.split(r"[|,]", value) if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not items:
            raise _Invalid(f"got {value!r}")
        names: List[str] = []
        for item in items:
            if not isinstance(item, str) or item.strip().upper() not in self.names:
                raise _Invalid(f"got {item!r} in {value!r}")
            if item.strip().upper() not in names:
                names.append(item.strip().upper())
        return tuple(names)

    def to_env(self, value: Tuple[str, ...]) -> str:
        return "|".join(value)

    def ort_read(self, raw: str) -> Tuple[str, ...]:
        if not all(name in self.names for name in raw.split("|")):
            raise _Invalid("ORT raises KeyError")
        return tuple(dict.fromkeys(raw.split("|")))  # ORT ORs the flags: a repeated name changes nothing


def _check_text(value: str) -> None:
    """Text that os.environ can hold: no NUL byte, encodable as the file system encoding (else apply() would fail
    halfway, in os.environ's setter)."""
    if "\0" in value:
        raise _Invalid(f"got {value!r}, which holds a NUL byte (an environment variable cannot)")
    try:
        os.fsencode(value)
    except UnicodeError:
        raise _Invalid(f"got {value!r}, which cannot be encoded for the environment") from None


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


class _Path(_Kind):
    """A path. ``what`` says how ORT uses it: "file" (an input ORT reads: it must exist), "dir" (ORT writes into
    it without creating it: an existing writable directory), "new dir" (ORT creates it with os.makedirs if needed:
    a writable directory, or a path whose nearest existing ancestor is one)."""

    type_name = "path"
    metavar = "PATH"

    def __init__(self, what: str, use: str):
        assert use in ("file", "dir", "new dir"), use
        self.use = use
        self.allowed = what

    def parse(self, value: Any) -> str:
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if not isinstance(value, str) or not value:
            raise _Invalid(f"got {value!r}")
        _check_text(value)
        if self.use == "file":
            # A missing input file is ignored silently by ORT (TRITON_CONFIG_FILE) or fails late.
            if not os.path.isfile(value):
                raise _Invalid(f"no such file {value!r}")
        elif os.path.isdir(value):
            if not os.access(value, os.W_OK | os.X_OK):
                raise _Invalid(f"{value!r} is a directory this process cannot write to")
        elif os.path.lexists(value):
            raise _Invalid(f"{value!r} exists and is not a directory")
        elif self.use == "dir":
            raise _Invalid(f"no such directory {value!r} (ORT {ORT_VERSION} checks that it is writable and does not "
                           "create it)")
        else:
            ancestor = _nearest_existing(value)
            if not os.path.isdir(ancestor):
                raise _Invalid(f"{value!r} cannot be created: {ancestor!r} is not a directory")
            if not os.access(ancestor, os.W_OK | os.X_OK):
                raise _Invalid(f"{value!r} cannot be created: {ancestor!r} is not writable")
        return value


# A recompute plan as ORT prints it: the cluster is the op types of the subgraph, each followed by '+'
# ("BiasGelu+", "FusedMatMul+Add+"); strategy 0 none, 1 recompute, 2 recompute with compromise; count = the first
# N occurrences, -1 all. ORT matches the cluster string exactly, so "BiasGelu" (no '+') would match nothing.
_OP_CLUSTER = re.compile(r"(?:[A-Za-z_][A-Za-z0-9_]*\+)+")
# ORT reads the strategy and the count with std::from_chars into a 32-bit int: no spaces, no '+', leading zeros fine;
# a count that does not fit makes ORT drop the plan without a word.
_INT32_MAX = 2**31 - 1


def _parse_plan(plan: str) -> str:
    parts = plan.strip().split(":")
    if len(parts) != 3:
        raise _Invalid(f"plan {plan!r} must have three ':'-separated parts <cluster>:<strategy>:<count>")
    cluster, strategy, count = (part.strip() for part in parts)
    if not _OP_CLUSTER.fullmatch(cluster):
        raise _Invalid(
            f"plan {plan!r}: cluster {cluster!r} must be op type names each followed by '+', as ORT prints them "
            "(e.g. 'BiasGelu+' or 'FusedMatMul+Add+')"
        )
    if strategy not in ("0", "1", "2"):
        raise _Invalid(
            f"plan {plan!r}: strategy {strategy!r} must be 0 (none), 1 (recompute) or 2 (recompute with compromise)"
        )
    if not re.fullmatch(r"-1|\d+", count):
        raise _Invalid(f"plan {plan!r}: count {count!r} must be an integer >= -1 (-1 = every occurrence)")
    if int(count) > _INT32_MAX:
        raise _Invalid(f"plan {plan!r}: count {count!r} is above {_INT32_MAX}, which ORT {ORT_VERSION} reads into a "
                       "32-bit int: it silently drops the plan")
    return f"{cluster}:{strategy}:{int(count)}"


def _ort_reads_plan(plan: str) -> Optional[str]:
    """Why ORT 1.19.2 cannot read this plan string (one of the ','-separated pieces of a string in the plan file)
    as meant, or None. ORT matches the cluster verbatim (" Gelu+" matches no subgraph, so a leading space recomputes
    nothing) and reads strategy and count with std::from_chars (a space or '+' there raises RuntimeError at the
    first forward)."""
    parts = plan.split(":")
    if len(parts) != 3:
        return f"plan {plan!r} does not have three ':'-separated parts (ORT raises RuntimeError at the first forward)"
    cluster, strategy, count = parts
    if not _OP_CLUSTER.fullmatch(cluster):
        return (f"plan {plan!r}: ORT matches the cluster {cluster!r} verbatim against op type names each followed "
                "by '+', so this plan recomputes nothing")
    if not re.fullmatch(r"\d+", strategy) or not re.fullmatch(r"-?\d+", count):
        return f"plan {plan!r}: ORT reads strategy and count as bare integers and raises RuntimeError at the first " \
               "forward on anything else (spaces, '+')"
    return None


class _Plans(_Kind):
    """ORTMODULE_MEMORY_OPT_CONFIG: since 1.19 the path of a JSON file holding a list of plan strings.

    parse()/from_env() normalise the plans (the values written are canonical); ort_read() checks the file's strings
    as they stand, since ORT strips nothing (_ort_reads_plan). An empty value is no plans to ORT."""

    type_name = "list[str]"
    metavar = "PLAN"
    allowed = (
        "a list of recompute plans '<op>+<op>+...:<strategy 0|1|2>:<count>', e.g. 'BiasGelu+:1:-1' "
        "(strategy 0 none, 1 recompute, 2 recompute with compromise; count -1 = all); "
        "the variable holds the path of a JSON file with that list"
    )
    ort_parsing = "reads a JSON list of plan strings from the file at this path"

    def parse(self, value: Any) -> Tuple[str, ...]:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise _Invalid(f"got {value!r}")
        plans: List[str] = []
        for item in value:
            if not isinstance(item, str):
                raise _Invalid(f"plan {item!r} is not a string")
            # ORT itself joins several plans of one cluster with ',' (that is how it prints them).
            plans.extend(_parse_plan(plan) for plan in item.split(",") if plan.strip())
        return tuple(plans)

    def to_env(self, value: Tuple[str, ...]) -> str:
        return _plan_file(value)

    def from_env(self, raw: str) -> Tuple[str, ...]:
        if raw == "":
            return ()  # ORT reads an empty value as no plan file (it tests len(path) > 0)
        return self.parse(self._read_file(raw))

    @staticmethod
    def _read_file(raw: str) -> List[Any]:
        try:
            with open(raw, encoding="utf-8") as f:
                data = json.load(f)
        except OSError:
            hint = " (inline plans were the format before 1.19)" if ":" in raw and not os.path.exists(raw) else ""
            raise _Invalid(f"{raw!r} is not a readable file{hint}") from None
        except ValueError as e:
            raise _Invalid(f"{raw!r} is not JSON ({e})") from None
        if not isinstance(data, list):
            raise _Invalid(f"{raw!r} holds {type(data).__name__}, not a JSON list of plan strings")
        return data

    def ort_read(self, raw: str) -> Tuple[str, ...]:
        """The plans as ORT reads the file: every string exactly as it stands (ORT strips nothing); then
        normalised, so that it compares with from_env()."""
        if raw == "":
            return ()  # ORT: no plan file
        for item in self._read_file(raw):
            if not isinstance(item, str):
                raise _Invalid(f"plan {item!r} is not a string")
            for plan in item.split(","):
                problem = _ort_reads_plan(plan)
                if problem is not None:
                    raise _Invalid(problem)
        return self.from_env(raw)

    def show(self, value: Tuple[str, ...]) -> str:
        return ", ".join(value) if value else "[] (no plans)"

    def fix(self, env: str, value: Tuple[str, ...]) -> str:
        return f"write {json.dumps(list(value))} into the file"


# --------------------------------------------------------------------------------------------------------------
# The recompute-plan file. ORT reads it when it builds the training graph (on the first forward call, not at
# construction), so it must outlive apply(): it is kept until the process ends. One file per distinct plan list.
# --------------------------------------------------------------------------------------------------------------

_PLAN_FILES: Dict[Tuple[str, ...], str] = {}


def _remove_plan_files() -> None:
    for path in _PLAN_FILES.values():
        try:
            os.remove(path)
        except OSError:
            pass
    _PLAN_FILES.clear()


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _plan_file(plans: Tuple[str, ...], path: Optional[str] = None) -> str:
    """Write plans as ORT 1.19 expects (a JSON list of plan strings) and return the file's path.

    With ``path`` the caller keeps the file (the command line does, for the shell that evals its output);
    without it the file lives in the temp directory and is removed when this process exits.
    """
    text = json.dumps(list(plans))
    if path is not None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        _write(path, text)
        return os.path.abspath(path)
    cached = _PLAN_FILES.get(plans)
    if cached is not None:
        try:
            with open(cached, encoding="utf-8") as f:
                if f.read() == text:
                    return cached
        except OSError:
            pass  # removed by someone: write it again
        _write(cached, text)
        return cached
    fd, name = tempfile.mkstemp(prefix="ort_optim_recompute_plans_", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    if not _PLAN_FILES:
        atexit.register(_remove_plan_files)
    _PLAN_FILES[plans] = name
    return name


# --------------------------------------------------------------------------------------------------------------
# The table.
# --------------------------------------------------------------------------------------------------------------

# When ORT reads a variable: per reading, what it means (for OptionsTooLateWarning) and, for the readings that
# happen once per process, the module whose presence in sys.modules means that moment has passed (so a new value can
# no longer take effect in this process); None for the readings that happen again for every ORTModule, which a new
# value still reaches for every module constructed (or, for "first forward", run for the first time) after it is
# written.
_READINGS: Dict[str, Tuple[str, Optional[str]]] = {
    "import": ("once per process, when onnxruntime.training.ortmodule is imported",
               "onnxruntime.training.ortmodule"),  # module-level code of the ortmodule package
    "first construction": ("once per process, when the first ORTModule is constructed",
                           "onnxruntime.training.ortmodule._custom_autograd_function"),  # imported by the 1st one
    "first Triton use": ("once per process, when ORT first loads its Triton code",
                         "onnxruntime.training.ort_triton"),  # module-level code of ort_triton
    "construction": ("in every ORTModule(...) constructor", None),
    "DebugOptions()": ("when DebugOptions(...) is constructed: inside ORTModule(...) when no debug_options is given",
                       None),
    "first forward": ("on each module's first forward call, when ORT exports the model and builds its session", None),
    "construction and first forward": ("in every ORTModule(...) constructor and again on its first forward call "
                                       "(export)", None),
    "load_from_json()": ("only when ortmodule.experimental.json_config.load_from_json() is called", None),
}
_READ_MEANINGS: Dict[str, str] = {read: meaning for read, (meaning, _) in _READINGS.items()}
_READ_MARKERS: Dict[str, Optional[str]] = {read: marker for read, (_, marker) in _READINGS.items()}


@dataclasses.dataclass(frozen=True)
class Variable:
    """One ORTModule environment variable: one row of the table."""

    env: str  # the variable's name
    kind: _Kind  # parsing, validation and the text written for ORT
    ort_default: str  # what ORT 1.19.2 does when the variable is unset
    meaning: str  # one line
    read: str = "construction"  # when ORT reads it: a key of _READ_MARKERS
    field: str = ""  # the ORTModuleOptions attribute; filled in from the class below
    flags: Tuple[str, ...] = ()  # extra command-line spellings

    def error(self, problem: str) -> ValueError:
        return ValueError(f"{self.field} ({self.env}): {problem}. Allowed: {self.kind.allowed}.")

    def parse(self, value: Any) -> Any:
        try:
            return self.kind.parse(value)
        except _Invalid as e:
            raise self.error(str(e)) from None

    def parse_env(self, raw: str) -> Any:
        """The value the text of the variable means (see _Kind.from_env); ValueError if it means nothing valid."""
        if raw.strip() == "" and not (raw == "" and isinstance(self.kind, _Plans)):
            # ORT crashes on most empty values (int("")) and treats the rest as unset; say so instead. (An empty
            # ORTMODULE_MEMORY_OPT_CONFIG is no plans to ORT, which tests len(path) > 0.)
            raise self.error("empty value; unset the variable instead")
        try:
            return self.kind.from_env(raw)
        except _Invalid as e:
            raise self.error(str(e)) from None

    def ort_problem(self, raw: str) -> Optional[str]:
        """Why ORT 1.19.2 cannot read this text as meant (None if it can): what ORT does with it, and the text to
        write instead where the text means a valid value."""
        try:
            meant = self.parse_env(raw)
        except ValueError as e:
            return str(e)
        try:
            seen = self.kind.ort_read(raw)
        except _Invalid as e:
            seen, why = None, f" ({e})"
        else:
            why = f" (it reads {self.kind.show(seen)})"
        if seen == meant:
            return None
        return (f"{self.env}={raw!r}: ORT {ORT_VERSION} {self.kind.ort_parsing}, so it cannot read this as meant"
                f"{why}; {self.kind.fix(self.env, meant)}")

    @property
    def cli_flags(self) -> Tuple[str, ...]:
        return self.flags + ("--" + self.field.replace("_", "-"),)


def _option(env: str, kind: _Kind, ort_default: str, meaning: str, read: str = "construction",
            flags: Sequence[str] = ()) -> Any:
    """Declare one ORTModuleOptions field: None (not set) by default, its variable in the field's metadata."""
    assert read in _READ_MARKERS, read
    variable = Variable(env=env, kind=kind, ort_default=ort_default, meaning=meaning, read=read, flags=tuple(flags))
    return dataclasses.field(default=None, metadata={"variable": variable})


_FALLBACK_POLICIES = (
    "FALLBACK_DISABLE",
    "FALLBACK_FORCE_TORCH_FORWARD",
    "FALLBACK_FORCE_TORCH_BACKWARD",
    "FALLBACK_UNSUPPORTED_DEVICE",
    "FALLBACK_UNSUPPORTED_DATA",
    "FALLBACK_UNSUPPORTED_TORCH_MODEL",
    "FALLBACK_UNSUPPORTED_ONNX_MODEL",
    "FALLBACK_BAD_INITIALIZATION",
)
_SKIP_CHECKS = ("SKIP_CHECK_DISABLED", "SKIP_CHECK_DEVICE", "SKIP_CHECK_BUILD_GRADIENT", "SKIP_CHECK_EXECUTION_AGENT")
_LOG_LEVELS = ("VERBOSE", "DEVINFO", "INFO", "WARNING", "ERROR", "FATAL")


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class ORTModuleOptions:
    """Settings for ORTModule, one typed field per ``ORTMODULE_*`` environment variable of ORT 1.19.2.

    Every field defaults to ``None``: not set here, so the environment, or else ORT's own default, applies.
    Values are validated and normalized on construction (``log_level="info"`` becomes ``"INFO"``, lists become
    tuples); a bad value raises ``ValueError`` naming the field, the variable and the allowed values.

    Precedence, highest first: an explicit argument here > the variable already set in the environment >
    ORT 1.19.2's default. ``apply()`` realizes it: it writes the explicit fields into ``os.environ`` and leaves
    every other variable as it is.

    ``to_env()`` emits every field that is set on this object (explicit arguments, and what ``from_env()`` read),
    and nothing for fields left ``None``: writing a variable is the only way to tell ORT something, and not
    writing one keeps the environment's value or ORT's default.

    ORT reads most variables when an ORTModule is constructed, some again (or only) on its first forward call,
    when it exports the model, and a few once per process (see the ``read`` column of the table), so apply the
    options before wrapping the model and leave them set: ``wrap(model, options)`` does that; ``apply()`` warns
    (``OptionsTooLateWarning``) when it changes a variable that ORT reads once per process and has already read.

    As a context manager the options are set on entry and restored on exit, so a variable ORT reads on the first
    forward call (ORTMODULE_MEMORY_OPT_LEVEL, ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT, ORTMODULE_TRITON_CONFIG_FILE)
    only takes effect if that call runs inside the block too; the block cannot tell when it does not, so use
    ``wrap()`` or ``apply()`` for those. Likewise a ``DebugOptions`` constructed before the block has already read
    ``log_level`` and ``save_onnx_path``; construct it inside the block, or pass it to ``wrap()``. The environment
    is process-wide: blocks nest within one thread, and entering one while a block entered in another thread is
    still open raises ``RuntimeError``.

    Integer fields take whatever ``operator.index()`` accepts (an IntEnum member, a numpy integer) and store a
    plain int. ``apply()`` warns (``ORTIgnoresWarning``) for values ORT reads and then ignores:
    ``label_sparse_optimizer=False`` (never used by ORT 1.19.2) and export settings next to a ``cache_dir`` that
    already holds exported models (ORT reuses them whatever the settings).

    Example::

        opts = ORTModuleOptions(memory_opt_level=1, log_level="INFO")
        model = wrap(model, opts)                      # apply(), then ORTModule(model); the variables stay set
        with ORTModuleOptions(onnx_opset_version=17):   # set on entry, restored on exit
            model = ORTModule(model)                   # read at construction: inside the block is enough
    """

    # Memory first.
    memory_opt_level: Optional[int] = _option(
        "ORTMODULE_MEMORY_OPT_LEVEL", _Int(choices=(0, 1, 2)), "0",
        "0: recompute only the plans in ORTMODULE_MEMORY_OPT_CONFIG; 1: recompute every recomputable subgraph in each "
        "transformer layer (like layer-wise activation checkpointing); 2: also subgraphs that keep part of an "
        "activation. Levels 1 and 2 ignore the plan file. Read again at the first forward call: there level 1 "
        "makes torch.utils.checkpoint regions run inline instead of failing the export, so it must still be set "
        "then. Level 2 fails ORT 1.19.2's export of fp16 models ('two nodes with same node name').",
        read="construction and first forward")
    recompute_plans: Optional[Tuple[str, ...]] = _option(
        "ORTMODULE_MEMORY_OPT_CONFIG", _Plans(), "unset (no plans)",
        "Recompute plans for level 0, written to a JSON file whose path is the variable's value (before 1.19 the "
        "variable held the plans inline). ORT logs the plans it finds at log level INFO.",
        flags=("--recompute-plan",))
    embedding_sparse_optimizer: Optional[bool] = _option(
        "ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER", _Bool(), "1 (ORT's docs say 0)",
        "Skip padding rows of embedding inputs when their density is below 90%; needs the compute optimizer. Off "
        "(0) makes ORT 1.19.2's first forward fail (TypeError; apply() warns).")
    label_sparse_optimizer: Optional[bool] = _option(
        "ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER", _Bool(), "1",
        "No effect in ORT 1.19.2: ORT reads it but never uses it. Skipping ignored labels in the loss (label density "
        "below 90%) follows embedding_sparse_optimizer instead, which ORT hands to its label hook; 0 here changes "
        "nothing (apply() warns).")
    mem_efficient_grad_mgmt: Optional[bool] = _option(
        "ORTMODULE_ENABLE_MEM_EFFICIENT_GRAD_MGMT", _Bool(), "0",
        "Hand each gradient to PyTorch as soon as ORT computes it, freeing ORT's gradient buffers early; needs "
        "custom autograd support. On (1) makes ORT 1.19.2's first forward fail (TypeError; apply() warns).")
    deepcopy_before_export: Optional[bool] = _option(
        "ORTMODULE_DEEPCOPY_BEFORE_MODEL_EXPORT", _Bool(), "1",
        "Deep-copy the module before exporting it; 0 avoids the memory peak of holding two copies.")
    print_memory_stats: Optional[bool] = _option(
        "ORTMODULE_PRINT_MEMORY_STATS", _Bool(), "0",
        "Print memory use per step (CUDA only: ORT skips it when CUDA is unavailable).")

    # The rest.
    print_input_density: Optional[bool] = _option(
        "ORTMODULE_PRINT_INPUT_DENSITY", _Bool(), "0",
        "Print the density of embedding and label inputs per step.")
    allow_autograd_checkpoint: Optional[bool] = _option(
        "ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT", _Bool("int or off"), "0",
        "Export torch.utils.checkpoint regions as PythonOp instead of failing; leave off when memory_opt_level=1 "
        "replaces the checkpointing.", read="first forward")
    compute_optimizer: Optional[bool] = _option(
        "ORTMODULE_ENABLE_COMPUTE_OPTIMIZER", _Bool(), "1",
        "FLOP reduction by moving shrinking ops (Gather, Slice, ...) earlier; 0 also turns off both sparse "
        "optimizers, which makes ORT 1.19.2's first forward fail (TypeError; apply() warns).")
    custom_autograd: Optional[bool] = _option(
        "ORTMODULE_ENABLE_CUSTOM_AUTOGRAD", _Bool("int or on"), "1",
        "Run torch.autograd.Function subclasses as PythonOp; 0 inlines them. Read once per process.",
        read="first construction")
    fallback_policy: Optional[str] = _option(
        "ORTMODULE_FALLBACK_POLICY", _OneFallbackPolicy(_FALLBACK_POLICIES),
        "FALLBACK_UNSUPPORTED_DEVICE|FALLBACK_UNSUPPORTED_DATA|FALLBACK_UNSUPPORTED_TORCH_MODEL|"
        "FALLBACK_UNSUPPORTED_ONNX_MODEL",
        "When ORT gives up and runs the PyTorch module instead. Setting it replaces ORT's four-policy default with "
        "one policy.")
    fallback_retry: Optional[bool] = _option(
        "ORTMODULE_FALLBACK_RETRY", _Bool("words"), "0",
        "After a fallback, try ORT again on the next call instead of staying on PyTorch.")
    log_level: Optional[str] = _option(
        "ORTMODULE_LOG_LEVEL", _Choice(_LOG_LEVELS), "WARNING",
        "ORTModule log level; INFO prints the memory optimizer's plans. Overrides DebugOptions(log_level=...) "
        "when it is set before that DebugOptions is constructed (wrap() re-reads it for a DebugOptions passed to "
        "it).", read="DebugOptions()")
    onnx_opset_version: Optional[int] = _option(
        "ORTMODULE_ONNX_OPSET_VERSION", _Int(minimum=17, maximum=20, note=f"below 17 ORT {ORT_VERSION} cannot train "
        "LayerNorm, below 11 not even Linear; 20 is torch 2.4's highest"), "17",
        "ONNX opset the model is exported with. 17 trains Linear, LayerNorm, GELU, Embedding, softmax, mean and "
        "cross-entropy; 18-20 the same except a mean over some dimensions whose input is used again (x - x.mean(-1, "
        "keepdim=True), as in a hand-written LayerNorm or RMSNorm: ORT's shape inference raises TypeError) and, in "
        "fp16 models, LayerNorm (its gradient's ReduceMean takes axes as an attribute: InvalidGraph).")
    save_onnx_path: Optional[str] = _option(
        "ORTMODULE_SAVE_ONNX_PATH", _Path("an existing directory this process can write to", "dir"),
        "the current directory",
        "Where the exported ONNX models go when DebugOptions(save_onnx=True); beats its save_path when it is set "
        "before that DebugOptions is constructed (wrap() re-reads it for a DebugOptions passed to it).",
        read="DebugOptions()")
    cache_dir: Optional[str] = _option(
        "ORTMODULE_CACHE_DIR", _Path("a writable directory, or one that can be created", "new dir"),
        "unset (no cache)",
        "Cache the exported ONNX model in this directory and reuse it across runs. ORT names the cached model after "
        "str(module) and the rank only, so a later run reuses it whatever its export settings (onnx_opset_version, "
        "allow_autograd_checkpoint, ...); empty the directory when changing them (apply() warns when it holds models).")
    efficient_attention: Optional[bool] = _option(
        "ORTMODULE_USE_EFFICIENT_ATTENTION", _Bool(), "0",
        "Replace attention subgraphs with PyTorch's efficient-attention ATen kernels; needs torch >= 2.3.",
        read="import")
    aten_sdpa_fallback: Optional[bool] = _option(
        "ORTMODULE_ATEN_SDPA_FALLBACK", _OnIfSet(), "unset (off)",
        "Export scaled_dot_product_attention as an ATen op run by PyTorch (efficient-attention kernel and its "
        "gradient). Any non-empty value turns it on, even 0.", read="import")
    zero_stage3: Optional[bool] = _option(
        "ORTMODULE_ENABLE_ZERO_STAGE3", _Bool(), "0",
        "DeepSpeed ZeRO stage 3 compatibility; once on, it stays on for the process.")
    conv_algo_search: Optional[str] = _option(
        "ORTMODULE_CONV_ALGO_SEARCH", _Choice(("HEURISTIC", "EXHAUSTIVE"), failure="warns and uses HEURISTIC"),
        "HEURISTIC",
        "cuDNN convolution algorithm search (CUDA only); ORT warns and uses HEURISTIC for any other value.")
    skip_check_policy: Optional[Tuple[str, ...]] = _option(
        "ORTMODULE_SKIPCHECK_POLICY", _NameSet(_SKIP_CHECKS),
        "SKIP_CHECK_DEVICE|SKIP_CHECK_BUILD_GRADIENT|SKIP_CHECK_EXECUTION_AGENT",
        "Checks ORT skips after the first step; SKIP_CHECK_DISABLED runs every check on every step. A policy that "
        "runs the gradient-graph check (SKIP_CHECK_BUILD_GRADIENT left out, or SKIP_CHECK_DISABLED given) makes ORT "
        "1.19.2's second training forward fail for a model whose forward reads a buffer (BatchNorm's running "
        "statistics, a registered mask): that check looks up every graph input but the user's among the "
        "parameters (AssertionError; wrap() warns).")
    json_config_path: Optional[str] = _option(
        "ORTMODULE_JSON_CONFIG_PATH", _Path("an existing JSON file", "file"), "unset",
        "ORTModule settings file read only by ortmodule.experimental.json_config.load_from_json(), where it "
        "overrides the path argument.", read="load_from_json()")

    # Triton and kernel tuning.
    use_triton: Optional[bool] = _option(
        "ORTMODULE_USE_TRITON", _Bool(), "0",
        "Run supported ops with Triton kernels; needs an ORT build with Triton and the triton package (the CPU "
        "wheel has no Triton, so ORT ignores it there).")
    triton_config_file: Optional[str] = _option(
        "ORTMODULE_TRITON_CONFIG_FILE", _Path("an existing JSON file", "file"),
        "unset (ORT's built-in op list)",
        "JSON file choosing what Triton fuses (ops, initializer, min_nodes); ORT silently ignores a missing file.",
        read="first forward")
    triton_debug: Optional[bool] = _option(
        "ORTMODULE_TRITON_DEBUG", _Bool(), "0",
        "Write the generated Triton code to ./triton_debug/.", read="first Triton use")
    flash_attention: Optional[bool] = _option(
        "ORTMODULE_USE_FLASH_ATTENTION", _Bool(), "0",
        "Use ORT's Triton flash-attention kernels; needs CUDA compute capability >= 8.0.", read="first Triton use")
    enable_tuning: Optional[bool] = _option(
        "ORTMODULE_ENABLE_TUNING", _Bool(), "0",
        "TunableOp: tune kernels online (CUDA execution provider only).")
    max_tuning_duration_ms: Optional[int] = _option(
        "ORTMODULE_MAX_TUNING_DURATION_MS", _Int(note="0 or less: ORT ignores it and keeps its default"),
        "0 (no limit)",
        "Time limit for TunableOp tuning, in milliseconds; ORT ignores values <= 0.")
    tuning_results_path: Optional[str] = _option(
        "ORTMODULE_TUNING_RESULTS_PATH", _Path("a writable directory, or one that can be created", "new dir"),
        "unset",
        "TunableOp results directory: saved there when tuning is on, loaded from there when it is off (CUDA only).")

    def __post_init__(self) -> None:
        for var in TABLE:
            value = getattr(self, var.field)
            if value is not None:
                object.__setattr__(self, var.field, var.parse(value))
        _check_conflicts(self)
        # Where each set field came from ("explicit" or "environment"), for describe(). Not dataclass fields, so
        # they take no part in ==, hash or repr.
        object.__setattr__(self, "_sources", {v.field: "explicit" for v in TABLE if getattr(self, v.field) is not None})
        object.__setattr__(self, "_plan_path", None)  # the plan file from_env() read, reused by to_env()
        object.__setattr__(self, "_saved", [])  # environments saved by __enter__, restored by __exit__

    def __repr__(self) -> str:
        given = ", ".join(f"{v.field}={getattr(self, v.field)!r}" for v in TABLE if getattr(self, v.field) is not None)
        return f"ORTModuleOptions({given})"

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "ORTModuleOptions":
        """Options holding every table variable set in ``environ`` (default ``os.environ``).

        Every text ORT 1.19.2 reads as meant is accepted, parsed as ORT parses that variable (``01`` is 1 where
        ORT calls ``int()``; ``yes`` turns ORTMODULE_FALLBACK_RETRY on), and so are the spellings ORT cannot read
        but whose meaning is plain (booleans true/false in any case, names in any case), which ``to_env()`` and
        ``apply()`` rewrite into what ORT reads. ORTMODULE_MEMORY_OPT_CONFIG is read as the path of a JSON list of
        plans (an empty value is no plans, as ORT reads it); the plans are normalised (spaces stripped), and a
        file whose strings ORT itself would read differently is rewritten by ``apply()``, while
        :func:`check_environment` reports it as it stands. Anything else raises ``ValueError`` naming the
        variable. Unknown ``ORTMODULE_*`` names are ignored here; :func:`check_environment` reports them.
        """
        environ = os.environ if environ is None else environ
        values = {v.field: v.parse_env(environ[v.env]) for v in TABLE if v.env in environ}
        options = cls(**values)
        options._sources.update(dict.fromkeys(values, "environment"))
        plans = _BY_FIELD["recompute_plans"]
        if plans.env in environ and _is_canonical_plan_file(environ[plans.env], options.recompute_plans):
            # The user's file is what ORT will read: keep it. A file whose strings we normalised (spaces, leading
            # zeros, several plans in one string) is not re-emitted: to_env() writes the normalised plans instead.
            object.__setattr__(options, "_plan_path", environ[plans.env])
        return options

    def replace(self, **changes: Any) -> "ORTModuleOptions":
        """A copy with some fields changed (those become explicit); the other fields keep their sources."""
        new = dataclasses.replace(self, **changes)
        new._sources.clear()
        new._sources.update({f: s for f, s in self._sources.items() if f not in changes})
        new._sources.update({f: "explicit" for f, v in changes.items() if v is not None})
        for field in [f for f in new._sources if getattr(new, f) is None]:
            del new._sources[field]
        if "recompute_plans" not in changes:
            object.__setattr__(new, "_plan_path", self._plan_path)
        return new

    def source(self, field: str, environ: Optional[Mapping[str, str]] = None) -> str:
        """Where the value ORT will see for ``field`` comes from: "explicit", "environment" or "default"."""
        if field in self._sources:
            return self._sources[field]
        environ = os.environ if environ is None else environ
        return "environment" if _BY_FIELD[field].env in environ else "default"

    def to_env(self, plan_file: Optional[str] = None) -> Dict[str, str]:
        """The variables for every field set on this object, as ORT 1.19.2 reads them, in table order.

        Booleans are written "1"/"0" (ORT parses ``int(value) == 1``). Recompute plans are written to a JSON file
        (a list of plan strings) and the variable holds its path: ``plan_file`` if given (the caller keeps it),
        else the file from_env() read them from if it still holds exactly those plans (it is read again here: it
        may have been rewritten or removed since), else a temp file removed when the process exits. Either way ORT
        reads the plans this object holds.
        """
        env: Dict[str, str] = {}
        for var in TABLE:
            value = getattr(self, var.field)
            if value is None:
                continue
            if isinstance(var.kind, _Plans) and plan_file is not None:
                env[var.env] = _plan_file(value, plan_file)
            elif (isinstance(var.kind, _Plans) and self._plan_path is not None
                  and _is_canonical_plan_file(self._plan_path, value)):
                env[var.env] = self._plan_path
            else:
                env[var.env] = var.kind.to_env(value)
        return env

    def _prepare(self) -> Dict[str, str]:
        """Everything apply() checks before it writes, and the variables it will write.

        Each set field is validated again (paths can change after construction), then checked against the
        variables already in ``os.environ`` for the fields this object leaves unset: a value that ORT would ignore
        given one of them is an error naming both. Nothing is written to os.environ here."""
        for var in TABLE:
            value = getattr(self, var.field)
            if value is not None:
                var.parse(value)
        self._check_environment_conflicts(os.environ)
        return self.to_env()

    def _check_environment_conflicts(self, environ: Mapping[str, str]) -> None:
        for a, b, conflict, why in _CONFLICTS:
            values = {a: getattr(self, a), b: getattr(self, b)}
            if (values[a] is None) == (values[b] is None):
                continue  # both set here (checked at construction), or neither: the environment's own business
            mine, other = (a, b) if values[a] is not None else (b, a)
            var, own = _BY_FIELD[other], _BY_FIELD[mine]
            if var.env not in environ:
                continue
            raw = environ[var.env]
            given = f"{mine} ({own.env}) = {own.kind.show(values[mine])} given here"
            problem = var.ort_problem(raw)  # the value as ORT itself reads this variable, not as from_env() would
            if problem is not None:
                raise ValueError(f"{given} depends on {var.env}={raw!r} in the environment, which ORT cannot read "
                                 f"as meant: {problem.rstrip('.')}. Set {other} here or fix the variable.")
            values[other] = var.kind.ort_read(raw)
            if conflict(values[a], values[b]):
                raise ValueError(
                    f"{given} conflicts with {var.env}={raw!r} in the environment ({other} = "
                    f"{var.kind.show(values[other])}): {why}. Set {other} here (it then replaces the environment's "
                    f"value) or unset {var.env}."
                )

    def _warn_late(self, env: Mapping[str, str], stacklevel: int) -> None:
        late = [(name, _BY_ENV[name]) for name, value in env.items()
                if not _same_for_ort(_BY_ENV[name], os.environ.get(name), value) and _already_read(_BY_ENV[name])]
        if late:
            lines = [f"  {name} (read {_READ_MEANINGS[var.read]}; {_READ_MARKERS[var.read]} is loaded)"
                     for name, var in late]
            warnings.warn(
                "ORT reads these variables once per process and has already read them, so the new values have no "
                "effect in this process:\n" + "\n".join(lines),
                OptionsTooLateWarning,
                stacklevel=stacklevel,
            )

    def _warn(self, env: Mapping[str, str]) -> None:
        """Before env is written: OptionsTooLateWarning (_warn_late) and ORTFailureWarning for the settings ORT 1.19.2
        fails with that env sets (with the environment's values of the fields it leaves unset), both pointing at the
        caller of apply(), the ``with`` statement or wrap()."""
        self._warn_late(env, stacklevel=4)
        lines = _ort_failures({**os.environ, **env}, written=env)
        if lines:
            warnings.warn(f"onnxruntime-training {ORT_VERSION} reads these settings as meant and then fails with "
                          "them, whatever the model:\n" + "\n".join("  " + line for line in lines),
                          ORTFailureWarning, stacklevel=3)
        lines = _ort_ignores({**os.environ, **env}, written=env)
        if lines:
            warnings.warn(f"onnxruntime-training {ORT_VERSION} reads these settings, which may not take effect:\n"
                          + "\n".join("  " + line for line in lines), ORTIgnoresWarning, stacklevel=3)

    @staticmethod
    def _write_environ(env: Mapping[str, str]) -> Dict[str, Optional[str]]:
        """Writes env into os.environ, all or nothing; returns the previous values (None: was not set)."""
        saved = {name: os.environ.get(name) for name in env}
        try:
            for name, value in env.items():
                os.environ[name] = value
        except BaseException:
            _restore_environ(saved)
            raise
        return saved

    def apply(self) -> Dict[str, str]:
        """Write ``to_env()`` into ``os.environ`` and return it; other variables are left as they are.

        All or nothing: every field is validated again first (paths writable where ORT writes), and a field whose
        value ORT would ignore given a variable already in the environment for a field left unset here (say
        ``recompute_plans`` with ``ORTMODULE_MEMORY_OPT_LEVEL=1`` exported by a job script) raises ``ValueError``
        naming both; os.environ is then unchanged. Such an environment variable is read as ORT reads it, so text
        ORT cannot read as meant (``true`` where ORT calls ``int()``, a plan file with spaces in its strings) is an
        error saying what ORT does with it.

        Warns (``OptionsTooLateWarning``) for each variable that ORT reads once per process, has already read, and
        would now read differently (``0`` replacing ``00`` is no change): those read at import (once
        onnxruntime.training.ortmodule is imported), at the first ORTModule's construction, or on first Triton use.
        The others are read again for every ORTModule, so the new values reach every module constructed later (and,
        for the variables read at the first forward call, every module whose first forward call comes later);
        modules that already read them keep what they read.
        """
        env = self._prepare()
        self._warn(env)
        self._write_environ(env)
        return env

    def __enter__(self) -> "ORTModuleOptions":
        """apply(), remembering what to restore on exit. ORT reads the variables marked "first forward" in the
        table when a module runs for the first time: run that call inside the block, or use wrap()/apply().

        The environment is process-wide, so blocks nest within one thread only: entering a block while a block
        entered in another thread is still open raises ``RuntimeError`` (the two threads' blocks would overwrite
        and then restore each other's values)."""
        me = threading.get_ident()
        with _OPEN_BLOCKS_LOCK:
            if _OPEN_BLOCKS["depth"] and _OPEN_BLOCKS["thread"] != me:
                raise RuntimeError(
                    "ORTModuleOptions block entered while a block entered in another thread is still open: the "
                    "ORTMODULE_* variables live in the process-wide environment, so the two blocks would overwrite "
                    "and then restore each other's values. Apply the options once, before starting the threads "
                    "(apply() or wrap()), or open the blocks in one thread.")
            env = self._prepare()  # raises before anything is written or saved
            self._warn(env)
            self._saved.append(self._write_environ(env))
            _OPEN_BLOCKS.update(thread=me, depth=_OPEN_BLOCKS["depth"] + 1)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        # Put back each variable apply() wrote: its old value, or remove it if it was not set before.
        with _OPEN_BLOCKS_LOCK:
            if not self._saved:
                raise RuntimeError("ORTModuleOptions.__exit__() without a matching __enter__(): this object has no "
                                   "open block whose variables it could restore")
            try:
                _restore_environ(self._saved.pop())
            finally:
                _OPEN_BLOCKS["depth"] -= 1

    def describe(self, environ: Optional[Mapping[str, str]] = None) -> str:
        """A text table: every variable, the value ORT will see once applied, and where it comes from.

        A field set here shows the value apply() writes. A variable left to the environment shows the value ORT
        reads from it, parsed as ORT parses it; text ORT cannot read as meant (``true`` where ORT calls
        ``int()``, an unknown name) is shown as ``'true' (INVALID)``, as check_environment() reports it."""
        environ = os.environ if environ is None else environ
        rows = [("variable", "field", "value", "source")]
        for var in TABLE:
            value = getattr(self, var.field)
            if value is not None:
                rows.append((var.env, var.field, var.kind.show(value), self._sources[var.field]))
            elif var.env in environ:
                raw = environ[var.env]
                if var.ort_problem(raw) is None:
                    shown = var.kind.show(var.kind.ort_read(raw))
                else:
                    shown = f"{raw!r} (INVALID)"
                rows.append((var.env, var.field, shown, "environment"))
            else:
                rows.append((var.env, var.field, var.ort_default, "default"))
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        title = f"ORTModule options (precedence: explicit > environment > ORT {ORT_VERSION} default)"
        lines = [title] + ["  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3] for row in rows]
        return "\n".join(line.rstrip() for line in lines)


TABLE: Tuple[Variable, ...] = tuple(
    dataclasses.replace(f.metadata["variable"], field=f.name) for f in dataclasses.fields(ORTModuleOptions)
)
_BY_FIELD: Dict[str, Variable] = {v.field: v for v in TABLE}
_BY_ENV: Dict[str, Variable] = {v.env: v for v in TABLE}


def _same_for_ort(var: Variable, old: Optional[str], new: str) -> bool:
    """Whether ORT reads the same value from both texts of the variable (" 1" and "1", "01" and "1")."""
    if old is None:
        return False
    if old == new:
        return True
    if var.ort_problem(old) is not None or var.ort_problem(new) is not None:
        return False
    return var.kind.ort_read(old) == var.kind.ort_read(new)


# The `with` blocks open in this process, and the thread they were entered in: os.environ is process-wide, so a
# block entered in a second thread while one is open would see (and, on exit, restore) the other thread's values.
_OPEN_BLOCKS: Dict[str, Any] = {"thread": None, "depth": 0}
_OPEN_BLOCKS_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    """A child of os.fork has only the thread that forked: the lock is made anew (another thread of the parent may
    hold it, and would never release it there), and blocks that another thread had open are forgotten (they never
    close in the child, whose environment keeps their values, as it was at the fork; its own blocks may then open).
    This module loads without the rest of ort_optim, so it renews its lock itself (ort_optim._fork does the
    others')."""
    global _OPEN_BLOCKS_LOCK
    _OPEN_BLOCKS_LOCK = threading.Lock()
    if _OPEN_BLOCKS["thread"] != threading.get_ident():
        _OPEN_BLOCKS.update(thread=None, depth=0)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _restore_environ(saved: Mapping[str, Optional[str]]) -> None:
    for name, old in saved.items():
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _is_canonical_plan_file(path: str, plans: Tuple[str, ...]) -> bool:
    """Whether the file holds exactly the normalised plans, one per string (so ORT reads what we validated)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f) == list(plans)
    except (OSError, ValueError):
        return False


# Settings ORT reads as meant and then fails with, whatever the model (onnxruntime-training 1.19.2, the last release;
# measured on CPU with torch 2.4.1): (fields, whether their values fail, how). apply() warns (ORTFailureWarning).
_ORT_FAILURES = (
    (("compute_optimizer", "embedding_sparse_optimizer"),
     lambda v: False in (v["compute_optimizer"], v["embedding_sparse_optimizer"]),
     "the embedding sparse optimizer is off (the compute optimizer off turns it off too), and ORTModule's first "
     "forward then raises TypeError: 'NoneType' object is not iterable (GraphTransitionManager hands the embedding "
     "flag to the label sparsity hook, which returns None for off, and iterates over that). Leave both on"),
    (("mem_efficient_grad_mgmt", "custom_autograd"),
     lambda v: v["mem_efficient_grad_mgmt"] is True and v["custom_autograd"] is not False,
     "memory-efficient gradient management is on, and ORTModule's first forward (its export) then raises TypeError in "
     "torch.zeros (_mem_efficient_grad_mgmt.py passes it a device it cannot take). Leave it off"),
)


# Variables ORT reads when it exports the model, so that their effect is part of the ONNX model it caches in
# ORTMODULE_CACHE_DIR (named after str(module) and the rank only, and reused as it is by later runs).
# What torch.onnx.export's graph depends on, which ORT caches as exported (the memory optimizer's level acts on the
# graph after the export: ORT applies it to a cached model too).
_EXPORT_SETTINGS = ("onnx_opset_version", "allow_autograd_checkpoint", "custom_autograd", "aten_sdpa_fallback")


def _ort_ignores(environ: Mapping[str, str], written: Mapping[str, str]) -> List[str]:
    """The values in ``written`` that ORT 1.19.2 reads and then ignores, given environ (the environment after the
    write), one line each: label_sparse_optimizer off, and export settings next to a cache_dir holding models."""
    lines = []
    label = _BY_FIELD["label_sparse_optimizer"].env
    if written.get(label) == "0":
        lines.append(f"{label}=0: ORT {ORT_VERSION} reads it and never uses it (the label sparsity optimization "
                     "follows ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER, which ORT hands to its label hook)")
    cache = environ.get(_BY_FIELD["cache_dir"].env, "")
    exports = [_BY_FIELD[f].env for f in _EXPORT_SETTINGS if _BY_FIELD[f].env in written]
    try:
        cached = sorted(name for name in os.listdir(cache) if name.endswith(".onnx")) if cache and exports else []
    except OSError:
        cached = []
    if cached:
        lines.append(f"{', '.join(exports)} with ORTMODULE_CACHE_DIR={cache}, which holds exported models "
                     f"({', '.join(cached[:3])}{', ...' if len(cached) > 3 else ''}): ORT names them after str(module) "
                     "and the rank only and loads them as they are, so export settings that differ from those of the "
                     "run that exported them do not take effect; empty the directory when changing them")
    return lines


def _ort_failures(environ: Mapping[str, str], written: Iterable[str]) -> List[str]:
    """The settings in environ that ORT reads as meant and then fails with (_ORT_FAILURES) and that involve one of the
    variables named in ``written``, one line each."""
    def value(field: str) -> Any:  # as ORT reads it
        var = _BY_FIELD[field]
        if var.env not in environ or var.ort_problem(environ[var.env]) is not None:
            return None  # (reported by check_environment())
        return var.kind.ort_read(environ[var.env])

    lines = []
    for fields, fails, what in _ORT_FAILURES:
        values = {field: value(field) for field in fields}
        if fails(values) and any(_BY_FIELD[f].env in written for f in fields):
            given = ", ".join(f"{_BY_FIELD[f].env}={environ[_BY_FIELD[f].env]}" for f in fields if values[f] is not None)
            lines.append(f"{given}: {what}")
    return lines


# Settings ORT accepts but silently ignores or overrides; explicit or from the environment, both sides known.
_CONFLICTS = (
    ("memory_opt_level", "recompute_plans", lambda level, plans: level in (1, 2) and bool(plans),
     "ORT ignores the plan file at levels 1 and 2; use memory_opt_level=0 with recompute_plans"),
    ("compute_optimizer", "embedding_sparse_optimizer", lambda compute, sparse: compute is False and sparse is True,
     "ORT turns the embedding sparse optimizer off when the compute optimizer is off"),
    ("custom_autograd", "mem_efficient_grad_mgmt", lambda custom, mem: custom is False and mem is True,
     "ORT ignores memory-efficient gradient management when custom autograd support is off"),
)


def _check_conflicts(options: ORTModuleOptions) -> None:
    for a, b, conflict, why in _CONFLICTS:
        va, vb = getattr(options, a), getattr(options, b)
        if va is not None and vb is not None and conflict(va, vb):
            A, B = _BY_FIELD[a], _BY_FIELD[b]
            raise ValueError(
                f"{a} ({A.env}) = {A.kind.show(va)} conflicts with {b} ({B.env}) = {B.kind.show(vb)}: {why}."
            )


# --------------------------------------------------------------------------------------------------------------
# Wrapping a model.
# --------------------------------------------------------------------------------------------------------------

def _already_read(var: Variable) -> bool:
    """Whether ORT has read this variable for the last time in this process (only the once-per-process ones)."""
    marker = _READ_MARKERS[var.read]
    return marker is not None and marker in sys.modules


def _debug_options_as_ort_reads_them(debug_options: Any, options: ORTModuleOptions) -> Any:
    """A copy of ``debug_options`` holding what ORT reads from the variables ``options`` set for it.

    ORT's DebugOptions reads ORTMODULE_LOG_LEVEL and ORTMODULE_SAVE_ONNX_PATH when it is constructed, and the
    variables beat its log_level and save_path arguments; one constructed before wrap() applied the options has
    not seen them. The copy repeats those two readings with ORT's own classes, now that the variables are set,
    which is what ORT would have read had the DebugOptions been constructed after apply(). The caller's object is
    left as it is; anything that is not a DebugOptions is passed on for ORTModule to reject.
    """
    from onnxruntime.training.ortmodule.options import DebugOptions, _LoggingOptions, _SaveOnnxOptions

    if not isinstance(debug_options, DebugOptions) or (options.log_level is None and options.save_onnx_path is None):
        return debug_options
    reread = copy.copy(debug_options)
    if options.log_level is not None:
        reread._logging = _LoggingOptions(debug_options.log_level)
    if options.save_onnx_path is not None:
        reread._save_onnx_models = _SaveOnnxOptions(
            debug_options.save_onnx, debug_options.onnx_prefix, debug_options.save_onnx_models.path
        )
    return reread


def _original_checkpoint_bindings(model: Any) -> List[Tuple[str, str]]:
    """(module, global) for each global that holds torch's own torch.utils.checkpoint.checkpoint (or a
    functools.partial of it) after onnxruntime.training.ortmodule replaced it, in the modules that define the
    classes of ``model``'s submodules (and their base classes, where helpers like HF transformers' bind it).

    ORT replaces the attribute torch.utils.checkpoint.checkpoint when onnxruntime.training.ortmodule is imported;
    a module that ran ``from torch.utils.checkpoint import checkpoint`` before that keeps the original function,
    which memory_opt_level=1 cannot run inline. Empty when ORT has not replaced the attribute (nothing to compare
    with) or ``model`` has no ``modules()``."""
    tuc = sys.modules.get("torch.utils.checkpoint")
    current = getattr(tuc, "checkpoint", None)
    if current is None or getattr(current, "__module__", None) == "torch.utils.checkpoint":
        return []
    try:
        submodules = list(model.modules())
    except Exception:  # not a torch.nn.Module: ORTModule says so itself
        return []
    names = dict.fromkeys(cls.__module__ for m in submodules for cls in type(m).__mro__)
    found = []
    for name in names:
        module = sys.modules.get(name)
        if module is None or name == "torch.utils.checkpoint":
            continue
        for attr, value in list(vars(module).items()):
            func = value.func if isinstance(value, functools.partial) else value
            try:
                original = (func is not current and callable(func) and func.__module__ == "torch.utils.checkpoint"
                            and func.__name__ == "checkpoint")
            except Exception:  # an object whose attribute lookup raises is not torch's function
                original = False
            if original:
                found.append((name, attr))
    return found


def _warn_checkpoint_bindings(model: Any) -> None:
    """ORTFailureWarning when ORT will run ``model`` at memory_opt_level=1 (ORTMODULE_MEMORY_OPT_LEVEL as ORT reads
    it, set here or in the environment), without ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT=1 (with which ORT exports
    torch's own checkpoint regions as they are), and the model's code holds torch's original checkpoint function
    (_original_checkpoint_bindings). Should the model run a region through it, ORT's export raises "Model uses
    gradient checkpointing..." at the first forward or, under ORT's default fallback policy, the model silently
    runs in PyTorch without any recompute; only the import order of the model's code fixes it. A warning and not an
    error: holding the function is not calling it (HF transformers' modeling_utils binds it for models that may
    never checkpoint), and nothing here can tell whether the model will."""
    def level(name: str) -> Optional[int]:
        raw = os.environ.get(name)
        try:
            return None if raw is None else int(raw)
        except ValueError:
            return None  # ORT raises on it itself, naming the variable
    if level("ORTMODULE_MEMORY_OPT_LEVEL") != 1 or level("ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT") == 1:
        return
    found = _original_checkpoint_bindings(model)
    if found:
        where = ", ".join(f"{module}.{attr}" for module, attr in found)
        warnings.warn(
            f"memory_opt_level (ORTMODULE_MEMORY_OPT_LEVEL) = 1 needs ORT's replacement of "
            f"torch.utils.checkpoint.checkpoint, which onnxruntime.training.ortmodule installs when it is imported, "
            f"but the model's code bound torch's original before that: {where} (`from torch.utils.checkpoint import "
            f"checkpoint` ran before the import). If the model checkpoints through it, ORT cannot run those regions "
            f"inline: the first forward raises, or under ORT's default fallback policy the model silently runs in "
            f"PyTorch. Import onnxruntime.training.ortmodule before the model's code (or call "
            f"torch.utils.checkpoint.checkpoint(...) through the module at call time).", ORTFailureWarning,
            stacklevel=3)


def _warn_buffers_under_gradient_check(model: Any) -> None:
    """ORTFailureWarning when ORT will run ``model`` with an ORTMODULE_SKIPCHECK_POLICY (as ORT reads it, set here or
    in the environment) under which it checks at every training forward whether its graph inputs still need
    gradients (SKIP_CHECK_BUILD_GRADIENT not in it, or SKIP_CHECK_DISABLED in it: ORT then skips nothing), and the
    model has buffers. That check (ORT 1.19.2's GraphTransitionManager._reprocess_check) asserts that every graph input
    but the user's is a parameter, and a buffer the forward reads is a graph input: the second training forward
    raises AssertionError ('<buffer> not exist parameter_names'). A warning and not an error: a buffer the forward
    does not read is not a graph input, and nothing here can tell which ones the forward reads."""
    raw = os.environ.get("ORTMODULE_SKIPCHECK_POLICY")
    if raw is None:
        return  # ORT's default skips the check
    names = raw.split("|")
    if not all(name in _SKIP_CHECKS for name in names):
        return  # ORT raises KeyError on it itself, naming the name
    if "SKIP_CHECK_BUILD_GRADIENT" in names and "SKIP_CHECK_DISABLED" not in names:
        return
    named_buffers = getattr(model, "named_buffers", None)
    buffers = [name for name, _ in named_buffers()] if callable(named_buffers) else []
    if buffers:
        shown = ", ".join(buffers[:4]) + (f" and {len(buffers) - 4} more" if len(buffers) > 4 else "")
        warnings.warn(
            f"skip_check_policy (ORTMODULE_SKIPCHECK_POLICY) = {raw} makes onnxruntime-training {ORT_VERSION} check "
            f"at every training forward whether the graph's inputs still need gradients, and that check takes every "
            f"graph input but the user's for a parameter: the model has buffers ({shown}), and if its forward reads "
            f"one, the second training forward raises AssertionError ('... not exist parameter_names'). Leave "
            f"skip_check_policy unset, or give one that includes SKIP_CHECK_BUILD_GRADIENT and not "
            f"SKIP_CHECK_DISABLED.", ORTFailureWarning, stacklevel=3)


def wrap(model: Any, options: Optional[ORTModuleOptions] = None, **ortmodule_kwargs: Any) -> Any:
    """Apply ``options`` to ``os.environ``, then return ``ORTModule(model, **ortmodule_kwargs)``.

    The variables stay set after the call: ORT reads some of them again on the module's first forward call
    (ORTMODULE_MEMORY_OPT_LEVEL, ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT, ORTMODULE_TRITON_CONFIG_FILE and the plan
    file). If importing or constructing ORTModule raises, every variable is put back as it was before the call.
    ``options=None`` leaves the environment as it is.

    ``log_level`` and ``save_onnx_path`` also reach a ``debug_options=DebugOptions(...)`` passed here, although
    ORT reads those variables when DebugOptions is constructed (before this call): ORTModule gets a copy of it
    with the two values read again as ORT reads them, the variable beating the DebugOptions argument.

    At memory_opt_level=1 (set here or in the environment, without allow_autograd_checkpoint), warns
    (``ORTFailureWarning``) when a module defining one of the model's submodule classes or their base classes holds
    torch's original ``torch.utils.checkpoint.checkpoint`` as a global (``from torch.utils.checkpoint import
    checkpoint`` ran before onnxruntime.training.ortmodule was imported, which is when ORT replaces that function):
    if the model checkpoints through it, ORT cannot recompute those regions, and the model fails its first forward
    or silently runs in PyTorch. A warning, not an error, since holding the function is not calling it (HF
    transformers binds it for every model); the message names the module, the global and the fix (import
    onnxruntime.training.ortmodule before the model's code). With a ``skip_check_policy`` (set here or in the
    environment) that runs ORT's gradient-graph check at every training forward (SKIP_CHECK_BUILD_GRADIENT left out,
    or SKIP_CHECK_DISABLED given), warns (``ORTFailureWarning``) when the model has buffers: ORT 1.19.2 takes a
    buffer the forward reads for a parameter there, and its second training forward raises. ``apply()`` and the
    context manager have no model to check.

    Needs onnxruntime-training 1.19.2's ORTModule, which works with torch 2.4.x.
    """
    saved: Dict[str, Optional[str]] = {}
    if options is not None:
        env = options._prepare()  # raises before anything is written
        options._warn(env)
        saved = options._write_environ(env)  # before the import: ORT reads some variables at import
    try:
        try:
            from onnxruntime.training.ortmodule import ORTModule
        except ImportError as e:
            raise ImportError(
                f"wrap() needs onnxruntime-training {ORT_VERSION}'s ORTModule, which works with torch 2.4.x: {e}"
            ) from e
        if options is not None and ortmodule_kwargs.get("debug_options") is not None:
            ortmodule_kwargs["debug_options"] = _debug_options_as_ort_reads_them(
                ortmodule_kwargs["debug_options"], options)
        _warn_checkpoint_bindings(model)
        _warn_buffers_under_gradient_check(model)
        return ORTModule(model, **ortmodule_kwargs)
    except BaseException:
        _restore_environ(saved)
        raise


# --------------------------------------------------------------------------------------------------------------
# The environment check, the guide's table and the command line.
# --------------------------------------------------------------------------------------------------------------


def check_environment(environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """Problems with the ``ORTMODULE_*`` variables in ``environ`` (default ``os.environ``), one line each.

    Reports unknown names (typos, with the closest known name), values we reject, values we accept but ORT
    1.19.2 cannot read as meant (``true`` for a boolean it parses with ``int()``, a lower-case log level, a plan
    string with spaces, which ORT reads verbatim), and combinations ORT silently ignores. An empty list means ORT
    will read everything as intended.
    """
    environ = os.environ if environ is None else environ
    problems: List[str] = []
    for name in sorted(n for n in environ if n.startswith("ORTMODULE_")):
        var = _BY_ENV.get(name)
        if var is None:
            close = difflib.get_close_matches(name, list(_BY_ENV), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            problems.append(f"{name}: unknown variable, onnxruntime-training {ORT_VERSION} does not read it{hint}")
            continue
        problem = var.ort_problem(environ[name])
        if problem is not None:
            problems.append(problem)
    if not problems:  # combinations only make sense once every value parses
        try:
            ORTModuleOptions.from_env(environ)
        except ValueError as e:
            problems.append(str(e))
    return problems


def _md(text: str) -> str:
    # '|' would end the cell; '<op>' would be read as an HTML tag and vanish.
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def markdown_table() -> str:
    """The table as Markdown, for guides/ortmodule-options.md (``python -m ort_optim.options --markdown``)."""
    lines = [
        f"| Variable | Field | Type | Allowed values | ORT {ORT_VERSION} default | Read at | Meaning |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in TABLE:
        cells = [f"`{v.env}`", f"`{v.field}`", v.kind.type_name, v.kind.allowed, v.ort_default, v.read, v.meaning]
        lines.append("| " + " | ".join(_md(c) for c in cells) + " |")
    return "\n".join(lines)


def _default_plan_file(plans: Tuple[str, ...]) -> str:
    """Where the command line keeps a plan file: it must outlive the command for the shell that evals it."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    digest = hashlib.sha1(json.dumps(list(plans)).encode()).hexdigest()[:12]
    return os.path.join(cache, "ort_optim", f"recompute-plans-{digest}.json")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ort_optim.options",
        description=(
            "Print `export VAR=value` lines for ORTModule's environment variables, then check the current "
            "environment for invalid ORTMODULE_* values and unknown names (exit code 1 if any)."
        ),
    )
    for var in TABLE:
        kwargs: Dict[str, Any] = dict(dest=var.field, metavar=var.kind.metavar,
                                      help=f"{var.env}: {var.meaning} Allowed: {var.kind.allowed}. "
                                           f"ORT default: {var.ort_default}.".replace("%", "%%"))
        if isinstance(var.kind, _Plans):
            kwargs.update(action="append")  # repeat the flag, or comma-join plans
        elif isinstance(var.kind, (_Bool, _OnIfSet)):
            kwargs.update(nargs="?", const="1")  # a bare flag turns it on
        parser.add_argument(*var.cli_flags, **kwargs)
    parser.add_argument("--plan-file", help="where to write the recompute plans (default: a file under "
                                            "$XDG_CACHE_HOME/ort_optim, which is kept)")
    parser.add_argument("--describe", action="store_true", help="print the table with current values and sources")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown and exit")
    parser.add_argument("--no-check", action="store_true", help="do not check the current environment")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown_table())
        return 0
    given = {v.field: getattr(args, v.field) for v in TABLE if getattr(args, v.field) is not None}
    try:
        options = ORTModuleOptions(**given)  # flag values are text, parsed like the environment's
    except ValueError as e:
        parser.error(str(e))  # exits with code 2

    exports: Dict[str, str] = {}
    if args.describe:
        print(options.describe())
    else:
        plan_file = None
        if options.recompute_plans is not None:
            plan_file = args.plan_file or _default_plan_file(options.recompute_plans)
        exports = options.to_env(plan_file=plan_file)
        for name, value in exports.items():
            print(f"export {name}={shlex.quote(value)}")
        if plan_file is not None:
            print(f"# wrote {len(options.recompute_plans)} recompute plan(s) to {plan_file}", file=sys.stderr)
        for failure in _ort_failures({**os.environ, **exports}, written=exports):  # (as apply() warns)
            print(f"# warning: onnxruntime-training {ORT_VERSION} fails with {failure}", file=sys.stderr)

    # Check the environment as it will be once the exports are evaluated: values replaced here are not problems.
    problems = [] if args.no_check else check_environment({**os.environ, **exports})
    for problem in problems:
        print(f"# {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
