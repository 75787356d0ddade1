"""Load and validate `specs/` (safe YAML → pydantic), with errors that name the file,
the field, the bad value and the allowed values."""

from __future__ import annotations

import enum
import os
import typing
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError

from .kernel import KernelFamily, tunables_model
from .route import Route


class SpecError(ValueError):
    """A spec file is malformed or illegal. `str()` is one line per problem."""

    def __init__(self, path: Path | str, problems: list[str]):
        self.path = str(path)
        self.problems = problems
        super().__init__("\n".join(f"{self.path}: {p}" for p in problems))


def default_specs_dir() -> Path:
    # specs/ sits beside the package in a checkout; an installed wheel carries none,
    # so FLAMIA_GEN_SPECS can point anywhere.
    env = os.environ.get("FLAMIA_GEN_SPECS")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "specs"


def _allowed_for(model: type[BaseModel], loc: tuple) -> list[str] | None:
    """Walk a pydantic model along an error location and list the allowed values there."""
    cur: typing.Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        if isinstance(cur, type) and issubclass(cur, BaseModel):
            f = cur.model_fields.get(str(part))
            if f is None:
                return None
            cur = f.annotation
        else:
            return None
        # unwrap Optional/list/dict/Union to the first model or enum inside
        for _ in range(4):
            origin = typing.get_origin(cur)
            if origin is None:
                break
            args = [a for a in typing.get_args(cur) if a is not type(None)]
            if origin is typing.Literal:
                return [repr(a) for a in typing.get_args(cur)]
            cur = args[-1] if args else cur
    if isinstance(cur, type) and issubclass(cur, enum.Enum):
        return [m.value for m in cur]
    if typing.get_origin(cur) is typing.Literal:
        return [repr(a) for a in typing.get_args(cur)]
    if isinstance(cur, type) and issubclass(cur, BaseModel):
        return list(cur.model_fields)
    return None


def _describe(model: type[BaseModel], err: dict) -> str:
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith(("function-", "tagged-"))))
    field_name = ".".join(str(p) for p in loc) or "<top level>"
    etype = err["type"]
    if etype == "extra_forbidden":
        parent = _allowed_for(model, loc[:-1]) if len(loc) > 1 else list(model.model_fields)
        return (f"field {field_name!r} is not a known field (misspelled?); "
                f"allowed fields: {parent}")
    if etype == "missing":
        return f"field {field_name!r} is required but missing"
    msg = err["msg"].removeprefix("Value error, ")
    bad = err.get("input")
    shown = "" if isinstance(bad, (dict, list)) or bad is None else f" (bad value {bad!r})"
    allowed = _allowed_for(model, loc) if loc else None
    tail = f"; allowed values: {allowed}" if allowed and etype in ("enum", "literal_error") else ""
    return f"field {field_name!r}{shown}: {msg}{tail}"


def _load_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise SpecError(path, [f"not valid YAML: {e}".replace("\n", " ")]) from None
    if not isinstance(data, dict):
        raise SpecError(path, ["top level must be a mapping"])
    return data


def parse_spec(model: type[BaseModel], path: Path, data: dict) -> BaseModel:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise SpecError(path, [_describe(model, err) for err in e.errors()]) from None


def load_route(path: Path | str) -> Route:
    path = Path(path)
    route = parse_spec(Route, path, _load_yaml(path))
    if route.name != path.stem:
        raise SpecError(path, [f"field 'name' (bad value {route.name!r}): must equal the file name "
                               f"{path.stem!r}"])
    return route  # type: ignore[return-value]


def _check_tunables(path: Path, data: dict) -> None:
    """The kind picks the tunables model; validate it first so errors carry the
    `tunables.` prefix and that model's allowed fields."""
    tun = data.get("tunables")
    if not isinstance(tun, dict):
        return
    model = tunables_model(data.get("kind"))
    try:
        model.model_validate(tun)
    except ValidationError as e:
        probs = []
        for err in e.errors():
            d = _describe(model, err)
            probs.append(d.replace("field '", "field 'tunables.", 1))
        raise SpecError(path, probs) from None


def load_family(path: Path | str, routes: dict[str, Route]) -> KernelFamily:
    path = Path(path)
    data = _load_yaml(path)
    _check_tunables(path, data)
    fam = parse_spec(KernelFamily, path, data)
    assert isinstance(fam, KernelFamily)
    unknown = [r for r in fam.routes if r not in routes]
    if unknown:
        raise SpecError(path, [f"field 'routes' (bad value {unknown!r}): unknown route; "
                               f"allowed values: {sorted(routes)}"])
    if fam.name != path.stem:
        raise SpecError(path, [f"field 'name' (bad value {fam.name!r}): must equal the file name "
                               f"{path.stem!r}"])
    return fam


@dataclass
class SpecSet:
    root: Path
    routes: dict[str, Route] = field(default_factory=dict)
    families: dict[str, KernelFamily] = field(default_factory=dict)

    def route(self, name: str) -> Route:
        if name not in self.routes:
            raise SpecError(self.root / "routes", [f"unknown route {name!r}; allowed values: "
                                                   f"{sorted(self.routes)}"])
        return self.routes[name]


def load_specs(root: Path | str | None = None) -> SpecSet:
    """Load every route and kernel family; all problems of all files in one SpecError."""
    root = Path(root) if root else default_specs_dir()
    if not (root / "routes").is_dir():
        raise SpecError(root, ["no routes/ folder here (set FLAMIA_GEN_SPECS or --specs)"])
    specs = SpecSet(root)
    problems: list[SpecError] = []
    for p in sorted((root / "routes").glob("*.yaml")):
        try:
            r = load_route(p)
            specs.routes[r.name] = r
        except SpecError as e:
            problems.append(e)
    for p in sorted((root / "kernels").glob("*.yaml")) if (root / "kernels").is_dir() else []:
        try:
            f = load_family(p, specs.routes)
            specs.families[f.name] = f
        except SpecError as e:
            problems.append(e)
    if problems:
        raise SpecError(root, [str(e) for e in problems]) if len(problems) > 1 else problems[0]
    return specs


@lru_cache(maxsize=4)
def _cached_routes(root: str) -> dict[str, Route]:
    return load_specs(root).routes


def get_route(name: str, root: Path | str | None = None) -> Route:
    """A shipped route by name (used by numerics and runtime)."""
    routes = _cached_routes(str(Path(root) if root else default_specs_dir()))
    if name not in routes:
        raise ValueError(f"unknown route {name!r}; allowed values: {sorted(routes)}")
    return routes[name]
