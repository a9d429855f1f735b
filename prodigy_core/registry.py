"""Rules and attacks by name: the one registration point, their settings, plug-ins from outside the package.

A class registers itself with a ``name`` (what a params file writes), a ``display`` name (what a table
prints) and optional named ``presets`` (``foe_0.1`` is FOE with eps=0.1); its settings are its ``__init__``
keywords. A plug-in is ``path/to/file.py:Class`` or ``package.module:Class``; the hash of its code (its file
and every ``.py`` file beside it, `plugin_hash`) is part of every result key. Only training imports a plug-in:
within `records_are_data` (reading records, a report, a dry run) a plug-in spec is data, never imported; its
file is read as text for its display name and literal defaults (`plugin_source`).
Entry points: `Registry`, `settings_of`, `load_plugin`, `is_plugin`, `records_are_data`.
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import functools
import hashlib
import importlib
import importlib.machinery
import importlib.util
import inspect
import json
import math
import operator
import re
import sys
import types
import typing
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from prodigy_core.names import TYPE_WORDS, did_you_mean

# Keywords a rule or an attack receives from the run itself, never from a params file.
RUN_KEYWORDS = ("self", "f", "variant", "generator")
SCALARS = (bool, int, float, str, type(None))


def packaged(cls: type) -> bool:
    """Whether ``cls`` is the package's own (defined in prodigy_core), not a plug-in's or a notebook's: the
    package's classes are pinned by its tests, so the checks for a plug-in author's mistakes skip them."""
    return cls.__module__.split(".")[0] == "prodigy_core"


def spec_hint(name: str) -> str:
    """For an unknown name that looks like a plug-in spec without its ':' (``rules/mine.py.Mine``), the form
    of one; else ""."""
    if "/" in name or ".py" in name:
        return "; a plug-in is written path/to/file.py:ClassName (a ':' before the class name)"
    return ""


class Entry(NamedTuple):
    """What a name stands for: the class, the settings its name fixes ({} for the class's own name), the
    name a table prints."""

    cls: type
    params: dict[str, Any]
    display: str


class Registry:
    """The classes of one kind (``defense``, ``attack``) by the names a params file uses.

    ``register`` (a class decorator) files the class under ``cls.name`` and every name of ``cls.presets``
    ({name: (display, settings)}); the did-you-mean lists, the report's names and the explorer's menus all
    read from here. ``needs``: the ``__init__`` parameters every class of the kind takes, and why (a rule's
    f), checked when a class is looked up."""

    def __init__(self, kind: str, needs: Mapping[str, str] | None = None) -> None:
        self.kind, self.needs = kind, dict(needs or {})
        self._entries: dict[str, Entry] = {}

    def register(self, cls: type) -> type:
        """File ``cls`` under its name and its presets' names. A name another class holds is a ValueError,
        but for a class of the same module and qualified name defined outside the package (a notebook's cell
        run again): it replaces that earlier definition, with a warning. A class whose ``__init__`` lacks a
        parameter of ``needs`` (a rule's f) is refused here, at the cell that defines it."""
        presets = {n: (d, dict(p)) for n, (d, p) in getattr(cls, "presets", {}).items()}
        own = {cls.name: (cls.display or cls.name, {})}
        names = {**presets, **own} if _needs_settings(cls) else {**own, **presets}  # ready names first
        for name in names:  # as a params file writes it: read in lower case, split at "+" and ":"
            if not isinstance(name, str) or not name or name != name.lower() or set(name) & set("+: /\t\n"):
                raise ValueError(
                    f"{self.kind} {cls.__name__}: the name {name!r} cannot be written in a params file; give "
                    "the class a lower-case name without spaces, '+', ':' or '/' (name = 'my_rule')"
                )
        self._check_needs(cls, cls.name)
        earlier = self._earlier_definition(cls)
        for name in names:
            known = self._entries.get(name)
            if known is not None and known.cls not in (cls, earlier):
                raise ValueError(f"{self.kind} name {name!r} is taken by {_taken_by(known.cls)}")
        if earlier is not None:
            self._entries = {n: e for n, e in self._entries.items() if e.cls is not earlier}
            warnings.warn(
                f"{self.kind} {cls.name!r}: {cls.__qualname__} from {cls.__module__} replaced its earlier "
                "definition",
                UserWarning,
                stacklevel=2,
            )
        for name, (display, params) in names.items():
            self._entries[name] = Entry(cls, params, display)
        return cls

    def _earlier_definition(self, cls: type) -> type | None:
        """The registered class ``cls`` redefines: another class of the same module and qualified name, both
        from outside the package (a notebook's cell run twice defines the class twice); None without one."""
        if packaged(cls):
            return None
        same = (cls.__module__, cls.__qualname__)
        return next(
            (
                e.cls
                for e in self._entries.values()
                if e.cls is not cls and not packaged(e.cls) and (e.cls.__module__, e.cls.__qualname__) == same
            ),
            None,
        )

    def _check_needs(self, cls: type, name: str) -> None:
        """A ValueError naming the fix unless ``cls.__init__`` takes every parameter of ``needs``."""
        takes = inspect.signature(cls.__init__).parameters
        for needed, why in self.needs.items():
            if needed not in takes:
                raise ValueError(f"{self.kind} {name!r}: {cls.__name__}.__init__ takes no {needed}: {why}")

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def ready(self) -> tuple[str, ...]:
        """The names that build without settings (``foe_0.1``, not ``foe``, which needs its eps): menus."""
        return tuple(n for n, e in self._entries.items() if not _needs_settings(e.cls, e.params))

    def lookup(self, name: str) -> Entry:
        """The entry of a registered name or of a plug-in spec (`load_plugin`); a ValueError with a
        did-you-mean hint otherwise."""
        if is_plugin(name):
            if not imports_plugins():
                raise ValueError(f"{self.kind} {name!r} is a plug-in: not imported while records are read")
            cls = load_plugin(name, self.kind)
            entry = Entry(cls, {}, self._plugin_display(getattr(cls, "display", "") or cls.__name__, name))
        elif name not in self._entries:
            hint = did_you_mean(name, self._entries)
            if not hint.startswith("; valid"):
                hint += f"; valid: {', '.join(self._entries)}"
            raise ValueError(f"unknown {self.kind} {name!r}{hint}{spec_hint(name)}")
        else:
            entry = self._entries[name]
        self._check_needs(entry.cls, name)
        return entry

    def unkeyed_class(self, name: str) -> type | None:
        """The class of a name registered from outside the package (``@RULES.register`` in a notebook or a
        script), whose code no result key holds: a key names it only. None for the package's own classes
        and for plug-in specs (their code hash is keyed)."""
        entry = None if is_plugin(name) else self._entries.get(name)
        if entry is None or packaged(entry.cls):
            return None
        return entry.cls

    def display(self, name: str, params: Mapping[str, Any] | None = None) -> str:
        """How a table prints ``name`` with ``params``: "FOE ε=0.1", "CClip (tau=5.0)" for {"tau": 5.0}."""
        entry = self.lookup(name)
        params = dict(params or {})
        if not params:
            return entry.display
        return f"{entry.display} ({settings_text(params)})"

    def display_label(self, text: str) -> str | None:
        """How a table prints a `label` (``cclip(tau=5.0)`` -> "CClip (tau=5.0)"); None when it names nothing
        this registry knows (or a plug-in whose file is gone)."""
        name, shown = split_label(text)
        try:
            entry = self.lookup(name)
        except ValueError:
            if not is_plugin(name):
                return None
            display = plugin_source(name, self.kind).display  # not imported (`records_are_data`): its text
            entry = Entry(object, {}, name if display is None else self._plugin_display(display, name))
        return f"{entry.display} ({shown})" if shown else entry.display

    def _plugin_display(self, display: str, spec: str) -> str:
        """A plug-in's display name, with its spec in brackets when a registered name has the same display,
        so that two rows never read alike."""
        taken = {e.display for e in self._entries.values()}
        return f"{display} [{spec}]" if display in taken else display

    def canonical(self, name: str, params: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        """(name, settings) in the one form a result key stores: settings checked against the class
        (`check_settings`), those equal to the class's defaults dropped, and a class's name with settings
        that equal a preset's written as that preset (``foe`` with eps=0.1 is ``foe_0.1``), so that one run
        has one key whichever way it was written."""
        if is_plugin(name) and not imports_plugins():  # its file's literal defaults, read as text
            source = plugin_source(name, self.kind)
            defaults, hints = source.settings or {}, source.hints or {}
            kept = {}
            for key, value in check_values(f"{self.kind} {name!r}", params).items():
                default = defaults.get(key, NOT_LITERAL)
                if default is NOT_LITERAL:
                    kept[key] = as_declared(value, hints.get(key))
                    continue
                value = as_declared(value, hints.get(key), default)
                value, differs = _against_default(value, as_declared(default, hints.get(key), default))
                if differs:
                    kept[key] = value
            return name, Settings(sorted(kept.items()))
        entry = self.lookup(name)
        full = check_settings(f"{self.kind} {name!r}", entry.cls, {**entry.params, **params})
        if full == entry.params:
            return name, Settings()
        for preset, other in self._entries.items():
            if other.cls is entry.cls and other.params and other.params == full:
                return preset, Settings()
        return (entry.cls.name if not is_plugin(name) else name), full


def _taken_by(cls: type) -> str:
    """Who holds a name another class asks for, and what to do."""
    if packaged(cls):
        return f"the package's {cls.__name__}: give yours another name (name = 'my_rule')"
    return (
        f"{cls.__qualname__}, registered earlier in this kernel from {cls.__module__}: give this class "
        "another name, or restart the kernel to drop the earlier one"
    )


def format_value(value: Any) -> str:
    """A setting's value as YAML reads it back to the same value and type, so that two settings that give
    two keys never give one label: 5 -> "5", 5.0 -> "5.0", 5.00001 -> "5.00001" (the shortest repr),
    True -> "true", None -> "null", "5" -> '"5"' (a text that would read as another type is quoted)."""
    import yaml

    if isinstance(value, list | tuple):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, str):
        try:
            plain = yaml.safe_load(value) == value and "," not in value and "=" not in value
        except yaml.YAMLError:
            plain = False
        return value if plain else json.dumps(value)
    return repr(value)


def settings_of(cls: type) -> dict[str, Any]:
    """The settings a params file may give ``cls``: its ``__init__`` keywords but the run's own (f, variant,
    generator), with their defaults (``inspect.Parameter.empty`` for a required one)."""
    signature = inspect.signature(cls.__init__)
    return {
        p.name: p.default
        for p in signature.parameters.values()
        if p.name not in RUN_KEYWORDS and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }


def _needs_settings(cls: type, given: Mapping[str, Any] = {}) -> bool:  # noqa: B006 (read only)
    return any(d is inspect.Parameter.empty and k not in given for k, d in settings_of(cls).items())


def check_settings(owner: str, cls: type, params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` checked against ``cls``'s settings: unknown names are an error with a did-you-mean hint, a
    required one missing is an error, values are YAML scalars or lists of them (NumPy scalars read as plain
    ones), an integer given for a float setting becomes a float (`as_declared`: 1 and 1.0, one key), and
    values equal to the default are dropped. Sorted."""
    valid = settings_of(cls)
    out = {}
    for key in params:
        if key not in valid:
            hint = did_you_mean(key, valid) if valid else "; it has no settings"
            raise ValueError(f"{owner} has no setting {key!r}{hint}")
    for key, value in check_values(owner, params).items():
        default = valid[key]
        hint = setting_hint(cls, key, default)
        _check_type(owner, key, value, default, hint)
        value = as_declared(value, hint, default)
        value, differs = _against_default(value, as_declared(default, hint, default))
        if differs:
            out[key] = value
    missing = [k for k, d in valid.items() if d is inspect.Parameter.empty and k not in out]
    if missing:
        raise ValueError(f"{owner} needs the setting(s) {', '.join(missing)} (e.g. {missing[0]}: 1.0)")
    return Settings(sorted(out.items()))


def _against_default(value: Any, default: Any) -> tuple[Any, bool]:
    """(the value as a key stores it, whether it differs from the default), both already `as_declared`: YAML
    has no tuples, so [0.25, 0.5] equals (0.25, 0.5)."""
    if isinstance(default, tuple) and isinstance(value, list) and tuple(value) == default:
        return value, False
    return value, value != default or type(value) is not type(default)


def setting_hint(cls: type, key: str, default: Any) -> Any:
    """The type a setting of ``cls`` declares: its ``__init__`` annotation, else (none, or one that does not
    resolve) its default's type; None when neither says (no annotation, a None or no default)."""
    try:
        hint = typing.get_type_hints(cls.__init__).get(key)
    except Exception:  # some annotation of a plug-in's does not resolve: this one's text, read as data
        annotation = inspect.signature(cls.__init__).parameters[key].annotation
        hint = _source_hint(ast.Constant(annotation)) if isinstance(annotation, str) else None
    if hint is None:
        hint = None if default is inspect.Parameter.empty or default is None else type(default)
    return hint


def _options(hint: Any) -> tuple[Any, ...]:
    """The types a hint allows: a union's members, else the hint itself (() for None: unknown)."""
    if hint is None:
        return ()
    union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    return typing.get_args(hint) if union else (hint,)


def as_declared(value: Any, hint: Any, default: Any = None) -> Any:
    """``value`` as a key stores it, so that 1 and 1.0 give one key: an integer (not a bool) becomes a float
    where the setting is a float, declared ``float`` or ``float | None`` (not ``int | float``: an integer is
    an integer there) or, undeclared, with a float default; each integer of a list or tuple becomes a float
    for ``tuple[float, ...]``. Anything else is kept as it is."""
    options = _options(hint)
    whole = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    if whole(value) and (float in options and int not in options or isinstance(default, float)):
        return float(value)
    floats = any(typing.get_origin(o) is tuple and typing.get_args(o) == (float, ...) for o in options)
    if floats and isinstance(value, list | tuple):
        return type(value)(float(v) if whole(v) else v for v in value)
    return value


def _check_type(owner: str, key: str, value: Any, default: Any, hint: Any) -> None:
    """A ValueError unless ``value`` fits the setting's `setting_hint` when that is made of int, float, bool,
    str and None: an integer setting (CClip's L) takes no 2.0, 2.5 or true, a number no true, no text and no
    list. The message names the default, when there is one, as an example: ``tau='abc' must be a number,
    like its default tau=10.0``, not the class's own comparison error."""
    options = _options(hint)
    if not options or not all(o in TYPE_WORDS for o in options):
        return
    number = isinstance(value, int | float) and not isinstance(value, bool)
    fits = {int: number and isinstance(value, int), float: number, bool: isinstance(value, bool),
            str: isinstance(value, str), type(None): value is None}  # fmt: skip
    if not any(fits[o] for o in options):
        fix = f" (write {int(value)})" if int in options and number and float(value).is_integer() else ""
        what = " or ".join(TYPE_WORDS[o] for o in options)
        no_default = default is inspect.Parameter.empty or default is None
        example = "" if no_default else f", like its default {key}={default!r}"
        raise ValueError(f"{owner}: {key}={value!r} must be {what}{fix}{example}")


def check_values(owner: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` whose values are YAML scalars or lists of them, numbers finite, NumPy scalars as the plain
    values they hold (`plain_value`); a ValueError otherwise."""
    params = {key: plain_value(value) for key, value in params.items()}
    for key, value in params.items():
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(v, SCALARS) for v in items):
            raise ValueError(f"{owner}: {key}={value!r} must be a number, a string, true/false or a list")
        if any(isinstance(v, float) and not math.isfinite(v) for v in items):
            raise ValueError(f"{owner}: {key}={value!r} must be finite")
    return params


def plain_value(value: Any) -> Any:
    """A NumPy scalar as the plain Python value it holds (np.int64(2) -> 2, np.float64(5) -> 5.0,
    np.bool_(True) -> True, np.str_("x") -> "x"), in a list or tuple too, so that its key and its label are
    the plain value's; anything else as it is."""
    if isinstance(value, list | tuple):
        return type(value)(plain_value(v) for v in value)
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return operator.index(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, np.str_):
        return str(value)
    return value


class Settings(dict):
    """A rule's or an attack's settings (``defense_params``, ``attack_params``): a dict that hashes, so that a
    frozen RunConfig holding one does too. Treat it as read-only."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple((k, _frozen(v)) for k, v in sorted(self.items())))


def _frozen(value: Any) -> Any:
    return tuple(_frozen(v) for v in value) if isinstance(value, list | tuple) else value


def settings_text(params: Mapping[str, Any]) -> str:
    """Settings as one line, sorted by name, each value as `format_value` writes it: {"tau": 5.0, "L": 2} ->
    "L=2, tau=5.0", {"rhos": [0.25, 0.5]} -> "rhos=[0.25, 0.5]" (`config.parse_settings` reads it back)."""
    return ", ".join(f"{k}={format_value(v)}" for k, v in sorted(params.items()))


def label(name: str, params: Mapping[str, Any]) -> str:
    """One text for a name with settings, as results frames and tables key their rows: ``cclip(tau=5.0)``
    for {"tau": 5.0}; the name alone without settings."""
    return f"{name}({settings_text(params)})" if params else name


def split_label(text: str) -> tuple[str, str]:
    """(name, settings text) of a `label`: ("cclip", "tau=5.0"); (text, "") without settings. The name ends
    at the first "(" that closes a plug-in spec (``.../my (copy)/rules.py:Mine(tau=5.0)``: a path may hold
    brackets, a class name cannot), else at the first "(" (a registered name holds none)."""
    if not text.endswith(")") or "(" not in text:
        return text, ""
    spec = _PLUGIN_NAME.match(text)
    cut = spec.end() if spec else text.index("(")
    return text[:cut], text[cut + 1 : -1]


# A plug-in spec followed by "(": the shortest text up to ":ClassName" (what a label's name is when it names
# a plug-in; the settings after it may hold ":" too, in a string).
_PLUGIN_NAME = re.compile(r".*?:[A-Za-z_]\w*(?=\()", re.DOTALL)


# ------------------------------------------------------------------------------------------ plug-ins


def is_plugin(name: str) -> bool:
    """Whether ``name`` names a class outside the registry: ``file.py:Class`` or ``module:Class``."""
    return isinstance(name, str) and ":" in name


def _split(spec: str, kind: str) -> tuple[str, str]:
    where, _, cls_name = spec.rpartition(":")
    if not where or not cls_name.isidentifier():
        raise ValueError(
            f"{kind} {spec!r}: a plug-in is written path/to/file.py:ClassName or package.module:ClassName"
        )
    return where, cls_name


def plugin_file(spec: str, kind: str = "plug-in") -> Path:
    """The file that defines a plug-in's class (a ``.py`` path is read relative to the current folder)."""
    where, _ = _split(spec, kind)
    if where.endswith(".py"):
        path = Path(where).expanduser()
        if not path.is_file():
            raise ValueError(
                f"{kind} {spec!r}: no file {where} (looked in {Path.cwd()}); give a path relative to the "
                "folder you run from, or an absolute one"
            )
        return path.resolve()
    try:
        module_spec = find_module(where)
    except (ImportError, ValueError) as e:
        raise ValueError(f"{kind} {spec!r}: cannot find module {where!r} ({e})") from None
    if module_spec is None or module_spec.origin is None or not Path(module_spec.origin).is_file():
        raise ValueError(f"{kind} {spec!r}: no module {where!r} on the Python path (is it installed?)")
    return Path(module_spec.origin).resolve()


def find_module(name: str) -> importlib.machinery.ModuleSpec | None:
    """Where the import system would find module ``name`` (``package.module``), found without running it or
    any package above it: `importlib.util.find_spec` imports the parents (their ``__init__`` runs), which
    reading a record must not. Asks the import system's finders (``sys.meta_path``) one level at a time,
    with the parent's search path; an already imported module or parent is taken as it is."""
    if not name or name.startswith(".") or not all(p.isidentifier() for p in name.split(".")):
        raise ValueError(f"{name!r} is not an absolute module name")
    spec, path = None, None
    parts = name.split(".")
    for i in range(len(parts)):
        full = ".".join(parts[: i + 1])
        module = sys.modules.get(full)
        if module is not None and getattr(module, "__spec__", None) is not None:
            spec = module.__spec__
        else:
            finders = (f for f in sys.meta_path if hasattr(f, "find_spec"))
            spec = next((s for f in finders if (s := f.find_spec(full, path)) is not None), None)
        if spec is None:
            return None
        path = spec.submodule_search_locations
        if path is None and i < len(parts) - 1:  # a module, not a package: nothing below it
            return None
    return spec


_IMPORTS = contextvars.ContextVar("prodigy_plugin_imports", default=True)


@contextlib.contextmanager
def records_are_data() -> Iterator[None]:
    """Within this block no plug-in is imported: a plug-in spec is text, its settings are checked as values
    only (`check_values`, kept as given) and `Registry.lookup` refuses it. Reading records (`results`,
    `gpu_run.py import`) and a dry run work inside it, so that a record or a params file never runs code
    until a run is trained."""
    token = _IMPORTS.set(False)
    try:
        yield
    finally:
        _IMPORTS.reset(token)


def imports_plugins() -> bool:
    """False inside `records_are_data`."""
    return _IMPORTS.get()


def plugin_code_files(spec: str, kind: str = "plug-in") -> list[Path]:
    """The files a plug-in's key covers: its file and every other regular ``*.py`` file in the same folder
    (the helpers it may import from beside it), not those in subfolders."""
    path = plugin_file(spec, kind)
    return sorted({path, *(p for p in path.parent.glob("*.py") if p.is_file())})


def plugin_hash(spec: str, kind: str = "plug-in") -> str:
    """sha256 (16 hex digits) of the plug-in's code, its file and every ``.py`` file beside it
    (`plugin_code_files`), names and contents: part of its runs' result keys, so that an edited rule or
    helper never reads the records of the old one."""
    return _code_hash(plugin_code_files(spec, kind))


def _code_hash(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}\0{hashlib.sha256(path.read_bytes()).hexdigest()}\0".encode())
    return digest.hexdigest()[:16]


NOT_LITERAL = object()  # a default `plugin_source` cannot read as a literal: only the import knows it


class PluginSource(NamedTuple):
    """What a plug-in's file says of its class when read as text (`ast`), without running it: its display
    name (None: only the import knows it), its settings with their defaults (`settings_of`'s form;
    ``NOT_LITERAL`` for a default that is not a literal; None when the class body has no plain
    ``__init__``) and the types their annotations declare where these are made of int, float, bool, str,
    None, ``X | Y``, ``Optional[X]`` and ``tuple[X, ...]`` (`as_declared` reads them as the import would)."""

    display: str | None
    settings: dict[str, Any] | None
    hints: dict[str, Any] | None = None


def plugin_source(spec: str, kind: str = "plug-in") -> PluginSource:
    """The class's display name and literal defaults as its file writes them, read as text, never run, so
    that a report of records, or a dry run, names a plug-in and keys its runs as training did without
    importing it (`records_are_data`). The display: a string literal ``display = "..."`` in the class body,
    else the class name when its bases are only ``Rule`` or ``Attack`` (as `Registry.lookup` names it);
    anything else is left to the import (None)."""
    try:
        _, cls_name = _split(spec, kind)
        tree = ast.parse(plugin_file(spec, kind).read_bytes())
    except (ValueError, OSError, SyntaxError, RecursionError, MemoryError):
        return PluginSource(None, None, None)
    node = next((n for n in reversed(tree.body) if isinstance(n, ast.ClassDef) and n.name == cls_name), None)
    if node is None:
        return PluginSource(None, None, None)
    return PluginSource(_source_display(node), *_source_settings(node))


def _literal(node: ast.expr | None) -> Any:
    if node is None:
        return inspect.Parameter.empty
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return NOT_LITERAL


def _source_display(node: ast.ClassDef) -> str | None:
    display: Any = None
    for stmt in node.body:  # the last assignment wins, as it does when the class body runs
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target, value = stmt.targets[0], stmt.value
        elif isinstance(stmt, ast.AnnAssign):
            target, value = stmt.target, stmt.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id == "display":
            display = _literal(value)
    if display is None:  # none in the body: inherited; the contract's base has none, so the class's name
        bases = [
            b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
            for b in node.bases
        ]
        return node.name if bases and set(bases) <= {"Rule", "Attack"} else None
    return (display or node.name) if isinstance(display, str) else None


def _source_settings(node: ast.ClassDef) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(settings with their literal defaults, the types their annotations declare) of a class's text."""
    inits = [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
    if not inits or inits[-1].decorator_list:  # inherited, or wrapped: only the import knows its signature
        return None, None
    a = inits[-1].args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    pairs = [(p, d) for p, d in zip(positional, defaults, strict=True) if p in a.args]  # not positional-only
    pairs += list(zip(a.kwonlyargs, a.kw_defaults, strict=True))
    pairs = [(p, d) for p, d in pairs if p.arg not in RUN_KEYWORDS]
    return {p.arg: _literal(d) for p, d in pairs}, {p.arg: _source_hint(p.annotation) for p, _ in pairs}


_SOURCE_TYPES = {"int": int, "float": float, "bool": bool, "str": str}


def _source_hint(node: ast.expr | None) -> Any:
    """The type an annotation's text declares, read without running it (`PluginSource`); None for any other
    annotation, or none."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a quoted annotation
        try:
            return _source_hint(ast.parse(node.value, mode="eval").body)
        except (SyntaxError, RecursionError, MemoryError, ValueError):
            return None
    if isinstance(node, ast.Constant) and node.value is None:
        return type(None)
    if isinstance(node, ast.Name):
        return _SOURCE_TYPES.get(node.id)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        left, right = _source_hint(node.left), _source_hint(node.right)
        return None if left is None or right is None else left | right
    if isinstance(node, ast.Subscript):
        base = node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", "")
        if base == "Optional":
            inner = _source_hint(node.slice)
            return None if inner is None else inner | None
        items = node.slice.elts if isinstance(node.slice, ast.Tuple) else []
        if base in ("tuple", "Tuple") and len(items) == 2:
            inner = _source_hint(items[0])
            ellipsis = isinstance(items[1], ast.Constant) and items[1].value is Ellipsis
            return tuple[inner, ...] if inner is not None and ellipsis else None
    return None


def load_plugin(spec: str, kind: str) -> type:
    """The class a plug-in spec names, imported without editing the package: a ``.py`` file is loaded as a
    module of its own (once per content of its folder's ``.py`` files, modules imported from that folder
    loaded again when those change), a module path is imported. A clear ValueError when the file, the
    module or the class is missing, or the class does not follow the contract (`Rule` / `Attack` subclass
    with ``name``). `loaded_hash` gives the hash of the code it loaded."""
    if not imports_plugins():
        raise ValueError(f"{kind} {spec!r}: plug-ins are not imported while records are read")
    where, cls_name = _split(spec, kind)
    path = plugin_file(spec, kind)
    digest = plugin_hash(spec, kind)
    if _FOLDERS.get(path.parent, digest) != digest:
        _forget_modules_in(path.parent)  # an edited helper is imported again, as the key says
    _FOLDERS[path.parent] = digest
    module = _load_file(str(path), digest) if where.endswith(".py") else _import_module(where, digest)
    cls = getattr(module, cls_name, None)
    if not isinstance(cls, type):
        found = [n for n, v in vars(module).items() if getattr(v, "__module__", None) == module.__name__]
        hint = did_you_mean(cls_name, found)
        raise ValueError(f"{kind} {spec!r}: {path.name} has no class {cls_name!r}{hint}")
    base = _CONTRACTS.get(kind)
    if base is not None and not issubclass(cls, base):
        raise ValueError(
            f"{kind} {spec!r}: {cls_name} must subclass {base.__module__}.{base.__name__} "
            f"(see its docstring for the few methods a new one implements)"
        )
    _LOADED[kind, spec] = digest
    return cls


def loaded_hash(spec: str, kind: str) -> str:
    """The `plugin_hash` of the code `load_plugin` last loaded for ``spec`` (what a record stores)."""
    return _LOADED[kind, spec]


_IMPORTED: dict[str, str] = {}  # module path -> hash of its code when imported
_FOLDERS: dict[Path, str] = {}  # a plug-in's folder -> hash of its code when last loaded
_LOADED: dict[tuple[str, str], str] = {}  # (kind, spec) -> hash of the code loaded


def _forget_modules_in(folder: Path) -> None:
    """Drop from sys.modules the modules loaded from ``folder``, so that the next import reads them again."""
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and not name.startswith("prodigy_plugin_") and Path(file).resolve().parent == folder:
            del sys.modules[name]


def _import_module(name: str, digest: str) -> Any:
    """The module ``name``, imported again when its code changed since (its hash is in the key: the code
    that runs must be the code the key names)."""
    module = importlib.import_module(name)
    if _IMPORTED.get(name, digest) != digest:
        module = importlib.reload(module)
    _IMPORTED[name] = digest
    return module


@functools.cache
def _load_file(path: str, digest: str) -> Any:
    name = f"prodigy_plugin_{Path(path).stem}_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"plug-in file {path} cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look classes up by module name
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ValueError(f"plug-in file {path} failed to import: {type(e).__name__}: {e}") from e
    return module


# kind -> the base class a plug-in must subclass; filled by the modules that define the bases.
_CONTRACTS: dict[str, type] = {}


def contract(kind: str, base: type) -> None:
    """Declare the base class that a plug-in of ``kind`` must subclass."""
    _CONTRACTS[kind] = base


__all__ = [
    "Entry",
    "Registry",
    "Settings",
    "check_settings",
    "as_declared",
    "check_values",
    "contract",
    "format_value",
    "imports_plugins",
    "is_plugin",
    "label",
    "load_plugin",
    "loaded_hash",
    "plugin_code_files",
    "plugin_file",
    "plugin_hash",
    "plugin_source",
    "plain_value",
    "records_are_data",
    "settings_of",
    "packaged",
    "settings_text",
    "spec_hint",
    "split_label",
]
