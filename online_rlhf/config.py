"""Typed stage configs: a YAML file plus ``key=value`` overrides, validated before any model loads.

Every stage script does::

    cfg = GenerateConfig.from_cli(sys.argv[1:])     # [--config FILE] [key=value ...]

A config class is a pydantic model that forbids unknown keys; each field has a ``description``
(its meaning; the default is the field's default). ``key=value`` values are parsed as YAML
(``k=4``, ``temperature=0.7``, ``stop=[a, b]``, ``lora=null``); dotted keys reach nested
mappings (``sampling.top_p=0.9``). Errors raise :class:`ConfigError` naming the file, the key
and how to fix it.
"""

from __future__ import annotations

import difflib
import re
import os
import sys
from pathlib import Path
from typing import Any, ClassVar, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator, model_serializer


class ConfigError(ValueError):
    """A config file or override is invalid. The message names the file/key and the fix."""


class DuplicateKeyError(yaml.YAMLError):
    """A mapping gives the same key twice (YAML would silently keep the last value).

    Attributes: ``key``; ``line`` and ``first_line`` (1-based) of the repeat and of the first one.
    """

    def __init__(self, key: Any, line: int, first_line: int):
        self.key, self.line, self.first_line = key, line, first_line
        super().__init__(f"line {line}: key {key!r} is given twice (first on line {first_line}); the later value "
                         "would silently win. Keep one of them.")


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-5`` as a float (YAML 1.1 wants a dot: ``1.0e-5``) and refuses a
    key given twice in one mapping (:class:`DuplicateKeyError`; ``<<`` merge keys may repeat keys)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict = {}  # key -> its 1-based line
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    hash(key)
                except TypeError:
                    continue  # the base class reports an unhashable key
                line = key_node.start_mark.line + 1
                if key in first:
                    raise DuplicateKeyError(key, line, first[key])
                first[key] = line
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                   |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                   |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                   |[-+]?\.(?:inf|Inf|INF)
                   |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


def yaml_load(text: str):
    """``yaml.safe_load`` with ``1e-5``-style floats; a key repeated in a mapping raises
    :class:`DuplicateKeyError` (a ``yaml.YAMLError``)."""
    return yaml.load(text, Loader=_Loader)


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"a.b=3"`` -> ``(["a", "b"], 3)``; the value is parsed as YAML (an empty value is ``""``)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key=value (e.g. temperature=0.7).")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r}: empty key.")
    try:
        value = yaml_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: value is not valid YAML ({e}).") from None
    return key.split("."), value


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """Return a copy of ``data`` with each ``key=value`` override set (dotted keys create nesting).

    A mapping value given for a key whose current value is a mapping is deep-merged into it
    (``'generation={k: 2}'`` sets ``generation.k`` and keeps the section's other keys, like
    ``generation.k=2``); any other value replaces the current one.

    Raises:
        ConfigError: an override that is not ``key=value``; a key given twice (naming the key and
            both overrides: the later one would silently win), also when one override sets it inside
            a mapping value and another by its dotted path (``'dpo={training: {beta: 0.2}}'`` and
            ``dpo.training.beta=0.3``); a dotted key inside a value that is not a mapping.
    """
    out = _deepcopy(data)
    seen: dict[str, str] = {}  # dotted leaf key -> the override that set it
    for item in overrides:
        path, value = parse_override(item)
        dotted = ".".join(path)
        leaves = _leaf_keys(dotted, value)
        for leaf in leaves:
            for other, by in seen.items():
                if leaf == other or leaf.startswith(other + ".") or other.startswith(leaf + "."):
                    key = min(leaf, other, key=len)
                    raise ConfigError(f"{key} is given twice on the command line: {by!r} and {item!r} (the later "
                                      "would silently win); give each key once.")
        for leaf in leaves:
            seen[leaf] = item
        node = out
        for part in path[:-1]:
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            elif not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a mapping, cannot set a key inside it.")
            node = nxt
        current = node.get(path[-1])
        if isinstance(value, dict) and isinstance(current, dict):
            node[path[-1]] = deep_merge(current, value)
        else:
            node[path[-1]] = value
    return out


def _leaf_keys(dotted: str, value: Any) -> list[str]:
    """The dotted keys an override sets: ``("a", {"b": {"c": 1}, "d": 2})`` -> ``["a.b.c", "a.d"]``;
    a non-mapping or empty mapping value sets ``dotted`` itself."""
    if not isinstance(value, dict) or not value:
        return [dotted]
    return [leaf for k, v in value.items() for leaf in _leaf_keys(f"{dotted}.{k}", v)]


def deep_merge(base: dict, update: dict) -> dict:
    """Recursively merge ``update`` into a copy of ``base`` (mappings merge, everything else replaces)."""
    out = _deepcopy(base)
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = _deepcopy(v)
    return out


def _deepcopy(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _deepcopy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_deepcopy(v) for v in x]
    return x


def load_yaml(path: str | os.PathLike) -> dict:
    """Load a YAML mapping; errors name the file (and line for syntax errors).

    Every config file (the loop config, ``dpo_config``, ``grpo_config``, a stage's ``--config``) is
    read here.

    Raises:
        ConfigError: no such file; invalid YAML; a key given twice in one mapping (naming the line
            and the key); a top level that is not a mapping.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} not found. Give the path of an existing YAML file (a stage script "
                          "takes it as --config PATH, the loop as its first argument, e.g. configs/loop.yaml).")
    try:
        data = yaml_load(path.read_text(encoding="utf-8"))
    except DuplicateKeyError as e:
        raise ConfigError(f"{path}, {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of key: value at the top level, got {type(data).__name__}.")
    return data


# Keys that stages took once and no longer do: an unknown-key message says why instead of a near miss.
REMOVED_KEYS = {"stats_output": "removed: a stage's stats always go to <output>.stats.json "
                                "(<output_dir>.stats.json for a checkpoint); drop the key"}


def did_you_mean(key: str, known) -> str:
    """`` Did you mean 'x'?`` for the closest of ``known`` to ``key`` (difflib), or ``""``; for a
    key in :data:`REMOVED_KEYS`, why it is gone."""
    if str(key) in REMOVED_KEYS:
        return f" {REMOVED_KEYS[str(key)]}."
    close = difflib.get_close_matches(str(key), sorted(known), n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def format_validation_error(err: ValidationError, cls: type[BaseModel], source: str) -> str:
    """Turn pydantic's error into lines that name the key, what is wrong and the fix, in the form the
    loop's section check uses (``online_rlhf.loop_keys.check_loop_keys``): ``SOURCE: N problem(s) in
    the config (CLASS):`` and then ``  - key: what is wrong.`` per problem."""
    problems = validation_problems(err, cls)
    return "\n".join([f"{source}: {len(problems)} problem(s) in the config ({cls.__name__}):",
                      *(f"  - {p}" for p in problems)])


def validation_problems(err: ValidationError, cls: type[BaseModel]) -> list[str]:
    """One ``key: what is wrong, and the fix.`` line per error of ``err`` (in ``err.errors()``'s
    order), as :func:`format_validation_error` lists them."""
    lines: list[str] = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            model = cls
            # suggest the closest known key at the same level
            for part in e["loc"][:-1]:
                f = model.model_fields.get(str(part))
                ann = getattr(f, "annotation", None) if f else None
                model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else model
            known = sorted(model.model_fields)
            lines.append(f"{key}: unknown key.{did_you_mean(e['loc'][-1], known)} Known keys: {', '.join(known)}.")
        elif e["type"] == "missing":
            lines.append(f"{key}: required, not set. Set it in the config file or as {key}=VALUE.")
        elif e["type"] == "value_error" and isinstance(e.get("input"), dict):
            # a check across keys (a model validator): its message names the keys and values itself;
            # the input is the whole mapping, not one offending value
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{msg}." if not e["loc"] else f"{key}: {msg}.")
        elif e["type"] == "string_type" and isinstance(e.get("input"), (int, float)):
            # YAML read an unquoted number (or true/false) where text is expected: say how to quote it
            leaf = ".".join(str(p) for p in e["loc"])
            if isinstance(e["input"], bool):  # the word itself is gone: yes, no, on, off, true, false all read as bools
                word = "WORD"
                what = f"an unquoted yes/no/on/off/true/false as the bool {str(e['input']).lower()}"
            else:
                word = str(e["input"])
                what = f"{word} as a number"
            lines.append(f"{key}: expected text, but YAML reads {what}. Quote it: "
                         f"{leaf}=\"'{word}'\" on the command line, {e['loc'][-1]}: '{word}' in a YAML file.")
        else:
            lines.append(f"{key}: {e['msg'].removeprefix('Value error, ')} (got {_short_repr(e.get('input'))}).")
    return lines


def _number_not_bool(annotation: Any) -> bool:
    """Whether a field type takes an int or a float but not a bool (``int``, ``Optional[float]``,
    ``Union[int, Literal["auto"]]``...); pydantic's lax mode would take ``true`` as 1 there."""
    import typing

    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return any(_number_not_bool(a) for a in args) and bool not in args
    return annotation in (int, float)


def _short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters with ``...`` (a long mapping still shows its first keys)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def bool_as_number_error(value: bool, fix: str = "give a number") -> ValueError:
    """The error for a YAML boolean given to a number key (one wording for every validator that checks it).

    ``fix`` ends the message: what the key does accept (e.g. ``give auto or a number`` for a key that
    also takes ``auto``).
    """
    return ValueError(f"expected a number, got the YAML boolean {str(value).lower()} (true/false, yes/no, "
                      f"on/off are booleans in YAML); {fix}")


class StageConfig(BaseModel):
    """Base class of every stage config: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(), allow_inf_nan=False)

    # Keys left out of a dumped config while they hold their default: keys added after runs were
    # planned (e.g. ``adapter``), so a run planned before keeps byte-identical stage YAMLs (and resume
    # hashes) and a run that does not use them shows no new line. Loading fills the default back in.
    omit_when_default: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_defaults(self, handler):
        d = handler(self)
        for k in self.omit_when_default:
            if isinstance(d, dict) and k in d and getattr(self, k) == type(self).model_fields[k].default:
                del d[k]
        return d

    @field_validator("*", mode="before")
    @classmethod
    def _refuse_bool_as_number(cls, value: Any, info: ValidationInfo) -> Any:
        """A YAML boolean (``true``, ``yes``, ``on``...) for an integer or float key is an error, not 1 or 0
        (pydantic's lax mode would turn ``iterations=true`` into 1 iteration)."""
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(value, bool) and field is not None and _number_not_bool(field.annotation):
            raise bool_as_number_error(value)
        return value

    @classmethod
    def dry_run_advice(cls, settings: dict, device: str, prefix: str) -> list[str]:
        """The settings to lower (or raise) when the stage's dry run does not fit, most effective
        first: one short line each, naming the key (``prefix`` + key: the loop section's name, e.g.
        ``dpo.``) with its current value in ``settings`` (:attr:`online_rlhf.stats.DryRunStats.settings`,
        which the stage's ``dry_run`` writes). ``device``: ``cpu`` or ``cuda``. A stage with a dry run
        overrides this (tests/test_stage_table.py checks that every row with one does).

        Raises:
            NotImplementedError: the stage has no dry run.
        """
        raise NotImplementedError(f"{cls.__name__} has no dry run, so no advice for one")

    @classmethod
    def from_dict(cls, data: dict, source: str = "<dict>"):
        """Validate ``data``; raise :class:`ConfigError` naming ``source`` and each bad key."""
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ConfigError(format_validation_error(e, cls, source)) from None

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, overrides: Sequence[str] = ()):
        """Read ``path`` (optional), apply ``key=value`` overrides, validate."""
        data = load_yaml(path) if path else {}
        data = apply_overrides(data, overrides)
        source = f"{path}" if path else "command line"
        if overrides:
            source += " + overrides " + " ".join(overrides)
        return cls.from_dict(data, source)

    @classmethod
    def from_cli(cls, argv: Sequence[str] | None = None):
        """Parse ``[--config FILE] [key=value ...]`` (also ``--config=FILE``); ``-h`` prints the fields.

        Raises:
            ConfigError: ``--config`` without a path or given twice, an unknown option, or any error
                of :meth:`load`.
        """
        argv = list(sys.argv[1:] if argv is None else argv)
        if any(a in ("-h", "--help") for a in argv):
            print(cls.help_text())
            raise SystemExit(0)
        path = None
        overrides: list[str] = []
        i = 0
        while i < len(argv):
            a = argv[i]
            if a == "--config" or a.startswith("--config="):
                if a == "--config" and i + 1 >= len(argv):
                    raise ConfigError("--config needs a file path.")
                given = argv[i + 1] if a == "--config" else a.split("=", 1)[1]
                if path is not None:
                    raise ConfigError(f"--config is given twice ({path} and {given}): only one file is read; give "
                                      "--config once (put the keys in one file, or override single keys with key=value).")
                path = given
                if a == "--config":
                    i += 2
                    continue
            elif a.startswith("--"):
                raise ConfigError(f"unknown option {a!r}. Use --config FILE and key=value overrides.")
            else:
                overrides.append(a)
            i += 1
        return cls.load(path, overrides)

    @classmethod
    def help_text(cls) -> str:
        prog = os.path.relpath(sys.argv[0]) if sys.argv and sys.argv[0] else "stage.py"
        lines = [f"{cls.__name__}: {(cls.__doc__ or '').strip().splitlines()[0] if cls.__doc__ else ''}",
                 f"usage: {prog} [--config FILE] [key=value ...]", "", "keys:"]
        return "\n".join(lines + cls._field_lines("  "))

    @classmethod
    def _field_lines(cls, indent: str, prefix: str = "", set_here: dict | None = None) -> list[str]:
        """One line per field (``name (default; choices): description``); a field typed by another
        ``StageConfig`` (a loop section) lists that class's fields below it as ``section.key``, with
        the defaults the section's own default sets (``set_here``: e.g. ``evaluation.k`` is 1, not the
        generation class's 4)."""
        lines = []
        set_here = set_here or {}
        for name, f in cls.model_fields.items():
            nested = f.annotation if isinstance(f.annotation, type) and issubclass(f.annotation, StageConfig) else None
            set_keys = {}
            if name in set_here:
                default = f"default {set_here[name]!r}"
            elif f.is_required():
                default = "required"
            elif nested is not None:
                set_keys = f.default_factory().model_dump(exclude_unset=True) if f.default_factory else {}
                default = f"section{'; set: ' + repr(set_keys) if set_keys else ''}"
            elif f.default_factory is not None:
                default = f"default {f.default_factory()!r}"
            else:
                default = f"default {f.default!r}"
            ann = getattr(f.annotation, "__args__", None)
            if ann and all(isinstance(a, str) for a in ann):  # Literal choices
                default += f"; one of {', '.join(ann)}"
            lines.append(f"{indent}{prefix}{name} ({default}): {f.description or ''}")
            if nested is not None:
                lines += nested._field_lines(indent + "  ", prefix=f"{prefix}{name}.", set_here=set_keys)
        return lines

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


def run_main(main, cls: type[StageConfig]) -> None:
    """Run ``main(cfg)`` for a stage script; config and data errors exit 2 with one clear message."""
    from .jsonl import DataError

    try:
        cfg = cls.from_cli()
        main(cfg)
    except (ConfigError, DataError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
