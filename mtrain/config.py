"""One dataclass tree for a run: YAML file + `a.b.c=value` overrides, validated at load.

    cfg = load_config("mtrain/configs/tiny_llama_grpo.yaml", ["algo.name=dapo", "optim.lr=2e-6"])
    print(cfg.format_config())

Every key is checked: an unknown key (in the file or an override) is an error that names the full dotted
key and suggests the closest valid one, a value of the wrong type names the key and the expected type.
Algorithm knobs left unset (None) are filled from the preset of `algo.name` (ALGO_PRESETS), so
`algo.name=dapo` alone gives clip-higher, token-mean aggregation and no KL, as in the paper.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from mtrain.config_checks import ConfigError, check_paths, refuse_secret_overrides, validate  # noqa: F401  (ConfigError, check_paths: re-exported)
from mtrain.config_sections import (ALGO_PRESETS, PARTIAL_OVER_SAMPLE, PATH_KEYS, RunConfig,  # noqa: F401  (RunConfig: re-exported)
                                   SECRET_KEYS, _field_of, _key_of)
from mtrain.paths import user_path




# ---- loading -------------------------------------------------------------------------------------------

def _leaf_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        t = _hints(cls)[f.name]
        if dataclasses.is_dataclass(t):
            keys.extend(_leaf_keys(t, f"{prefix}{f.name}."))
        else:
            keys.append(f"{prefix}{_key_of(f.name)}")
    return keys


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unknown_key(key: str, source: str) -> ConfigError:
    leaves = _leaf_keys(RunConfig)
    parent, _, leaf = key.rpartition(".")
    # The right name in the wrong section (train.lr): the same name elsewhere, the shallowest first (optim.lr before
    # model.lora.lr). Fuzzy matching of the whole key guessed a section name ('train') or an unrelated key here.
    elsewhere = [k for k in leaves if k.rpartition(".")[2] == leaf]
    elsewhere = [k for k in elsewhere if k.count(".") == min((e.count(".") for e in elsewhere), default=0)]
    # a section name is a valid key only at the top level (a YAML mapping), not the suggestion for a dotted key
    valid = leaves + ([] if parent else [f.name for f in dataclasses.fields(RunConfig)])
    close = (difflib.get_close_matches(key, elsewhere, n=1, cutoff=0) if elsewhere else
             difflib.get_close_matches(key, valid, n=1, cutoff=0.6))
    if not close:  # a typo in the last part only: compare against the siblings' names
        siblings = [k.rpartition(".")[2] for k in valid if k.rpartition(".")[0] == parent]
        near = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.5)
        close = [f"{parent}.{near[0]}" if parent else near[0]] if near else []
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"unknown config key '{key}' ({source}){hint}")


def _type_name(t: Any) -> str:
    if typing.get_origin(t) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(t))
    return getattr(t, "__name__", None) or str(t).replace("typing.", "")


def _coerce(value: Any, t: Any, key: str) -> Any:
    """Check/convert one value to the field type `t`; errors name the key."""
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1:
            return _coerce(value, non_none[0], key)
        raise ConfigError(f"{key}: unsupported union type {t}")  # not used by the tree above
    if origin is Literal:
        if isinstance(value, bool) and ("on" if value else "off") in args:
            value = "on" if value else "off"  # YAML 1.1 reads a bare off / on as a boolean
        if value not in args:
            raise ConfigError(f"{key}: {_shown(value, key, False)} is not {_type_name(t)}")
        return value
    if origin is dict:  # a free-form mapping (engine.server_args): str keys, YAML values kept as they are
        if isinstance(value, str):  # "{a: 1, b: x}" from a shell override
            value = _yaml_value(value) if value.strip() else {}
        if value is None:
            return {}
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{key}: expected a mapping of names to values, got {_shown(value, key, False)}")
        return dict(value)
    if origin is list:
        (elem,) = args
        if isinstance(value, str):  # "1,2,3" or "[1, 2, 3]" from a shell override
            whole = _yaml_value(value)
            value = whole if isinstance(whole, list) else [_yaml_value(v) for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            value = [value]
        return [_coerce(v, elem, f"{key}[{i}]") for i, v in enumerate(value)]
    if t is bool:
        if isinstance(value, bool):
            return value
    elif t is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif t is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # PyYAML reads "1e-6" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif t is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    else:
        raise ConfigError(f"{key}: unsupported field type {t}")
    raise ConfigError(f"{key}: expected {_type_name(t)}, got {_shown(value, key)}")


def _shown(value: Any, key: str, with_type: bool = True) -> str:
    """A bad value as an error message shows it; a secret's is not shown (the message reaches logs and trackers)."""
    if key.split("[", 1)[0] in SECRET_KEYS:
        return f"a {type(value).__name__} (not shown: {key} is a secret)"
    return f"{value!r} ({type(value).__name__})" if with_type else repr(value)


def _build(cls: type, data: Any, prefix: str, source: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"'{prefix.rstrip('.') or '<root>'}' ({source}) must be a mapping of keys, "
                          f"got {type(data).__name__}")
    hints = _hints(cls)
    names = {_key_of(f.name) for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if k not in names:
            raise _unknown_key(key, source)
        t = hints[_field_of(k)]
        kwargs[_field_of(k)] = _build(t, v, f"{key}.", source) if dataclasses.is_dataclass(t) else _coerce(v, t, key)
    return cls(**kwargs)


def _is_str_field(t: Any) -> bool:
    args = [a for a in typing.get_args(t) if a is not type(None)] or [t]
    return args == [str]


def _yaml_value(raw: str) -> Any:
    """A shell override's value as YAML reads it; text YAML cannot read (`[1`, `@x`) stays text, which the key's type
    check then names in one line (a ParserError traceback before)."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _apply_override(tree: dict, override: str) -> None:
    text = override[2:] if override.startswith("--") else override
    if "=" not in text:
        raise ConfigError(f"override {override!r} must look like section.key=value")
    key, raw = (s.strip() for s in text.split("=", 1))
    parts = key.split(".")
    cls, node = RunConfig, tree
    for i, part in enumerate(parts):
        names = {_key_of(f.name) for f in dataclasses.fields(cls)}
        if part not in names:
            raise _unknown_key(key, f"override {override!r}")
        t = _hints(cls)[_field_of(part)]
        last = i == len(parts) - 1
        if dataclasses.is_dataclass(t):
            if last:
                raise ConfigError(f"override {override!r}: '{key}' is a section; set one of its keys, "
                                  f"e.g. {_leaf_keys(t, key + '.')[0]}=...")
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"'{key}' must be a mapping")
            cls = t
        elif typing.get_origin(t) is dict and not last:  # engine.server_args.NAME=value: one entry of the mapping
            entries = node.setdefault(part, {})
            if not isinstance(entries, dict):
                raise ConfigError(f"'{'.'.join(parts[:i + 1])}' must be a mapping")
            entries[".".join(parts[i + 1:])] = _yaml_value(raw) if raw else None
            return
        elif not last:
            raise _unknown_key(key, f"override {override!r}")
        elif _is_str_field(t) and raw not in ("null", "None", "~"):
            node[part] = raw  # keep strings verbatim: YAML would turn "no" into False, "007" into 7
        else:
            node[part] = _yaml_value(raw) if raw else None


def switch_data_source(file_tree: dict, tree: dict, overrides) -> list[str]:
    """`data.train_path=FILE` on the command line replaces the config file's generated task (and `data.task=X`
    replaces the file's train/eval files): the two are alternatives, so the override says which one this run
    uses, and one override is enough to train on your own data. The task's eval set goes with it: evaluation
    settings from the file are turned off unless `data.eval_path` is given too. Returns notes saying what was
    replaced. Both sources set in the same place (file, or overrides) stay an error."""
    given = {o.lstrip("-").split("=", 1)[0].strip() for o in overrides if "=" in o}
    data, file_data = tree.get("data") or {}, file_tree.get("data") or {}
    notes = []
    if ("data.train_path" in given and data.get("train_path") is not None and "data.task" not in given
            and file_data.get("task") is not None):
        notes.append(f"data.train_path replaces the config file's data.task={data.pop('task')!r}")
        if data.get("eval_path") is None:
            train, file_train = tree.setdefault("train", {}), file_tree.get("train") or {}
            off = [k for k in ("eval_interval", "val_before_train") if file_train.get(k) and f"train.{k}" not in given]
            for k in off:
                train[k] = 0 if k == "eval_interval" else False
            if off:
                notes.append(f"no data.eval_path: evaluation ({', '.join('train.' + k for k in off)} from the file) is "
                             "off; add data.eval_path=FILE to evaluate")
    if ("data.task" in given and data.get("task") is not None and "data.train_path" not in given
            and file_data.get("train_path") is not None):
        dropped = [k for k in ("train_path", "eval_path") if data.get(k) is not None and f"data.{k}" not in given]
        for k in dropped:
            data.pop(k)
        notes.append(f"data.task={data['task']!r} replaces the config file's {', '.join('data.' + k for k in dropped)}")
    return notes


def resolve_presets(cfg: RunConfig) -> RunConfig:
    """Fill the algorithm knobs left at None from ALGO_PRESETS[cfg.algo.name] (in place), and
    rollout.over_sample with PARTIAL_OVER_SAMPLE when partial rollout is on."""
    for k, v in ALGO_PRESETS[cfg.algo.name].items():
        if getattr(cfg.algo, k) is None:
            setattr(cfg.algo, k, v)
    if cfg.rollout.partial and cfg.rollout.over_sample is None:
        cfg.rollout.over_sample = PARTIAL_OVER_SAMPLE
    return cfg


def _field(cfg: RunConfig, key: str) -> tuple[Any, str]:
    """The section object holding a dotted key and the key's field name in it."""
    *sections, name = key.split(".")
    obj = cfg
    for part in sections:
        obj = getattr(obj, part)
    return obj, _field_of(name)


def expand_user_paths(cfg: RunConfig) -> RunConfig:
    """`~` expanded in every PATH_KEYS value (in place): the one place it happens, so no reader has to."""
    for key in PATH_KEYS:
        obj, field = _field(cfg, key)
        value = getattr(obj, field)
        if isinstance(value, list):
            setattr(obj, field, [user_path(v) for v in value])
        elif value:
            setattr(obj, field, user_path(value))
    return cfg


def path_values(cfg: RunConfig) -> list[tuple[str, str]]:
    """(key, value) of every set PATH_KEYS value, a list key's items one by one."""
    out = []
    for key in PATH_KEYS:
        obj, field = _field(cfg, key)
        value = getattr(obj, field)
        out.extend((key, v) for v in (value if isinstance(value, list) else [value]) if v)
    return out


def _yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's message on one line (its own has several: a caret under a copy of the line); the error line is one
    write, which keeps ranks' lines whole."""
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
    if mark is None or not problem:
        return " ".join(str(e).split())
    context = getattr(e, "context", None)
    return f"line {mark.line + 1}, column {mark.column + 1}: {f'{context}: ' if context else ''}{problem}"


# Set by `mtrain train --nproc-per-node N` for the ranks it starts: it printed the config's notes already.
NOTES_SHOWN = "MTRAIN_CONFIG_NOTES_SHOWN"


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = (), *,
                check_files: bool = False) -> RunConfig:
    """Load a YAML file (or start from defaults when None), apply `a.b.c=value` overrides, validate;
    check_files also runs check_paths (the trainer should: it fails before any GPU work starts)."""
    tree: dict = {}
    source = "defaults"
    if path is not None:
        path = Path(user_path(str(path)))
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(e)}") from None
        source = str(path)
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    _build(RunConfig, tree, "", source)  # report unknown keys / bad types of the file itself first
    file_tree = copy.deepcopy(tree)
    refuse_secret_overrides(overrides)
    for o in overrides:
        _apply_override(tree, o)
    for note in switch_data_source(file_tree, tree, overrides):
        if os.environ.get("RANK", "0") == "0" and not os.environ.get(NOTES_SHOWN):
            print(f"mtrain: note: {note}", file=sys.stderr)
    cfg = _build(RunConfig, tree, "", f"{source} + overrides" if overrides else source)
    expand_user_paths(cfg)
    resolve_presets(cfg)
    validate(cfg)
    if check_files:
        check_paths(cfg)
    return cfg
