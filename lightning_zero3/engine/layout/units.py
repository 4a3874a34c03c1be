"""Which modules are units, and which parameters each unit owns.

A *unit* is a module whose parameters are gathered together just before its forward (and backward) and
released right after. The *root* unit is the top module: it owns every parameter that no other unit
owns, and it stays gathered while the whole forward runs (as in torch FSDP).

Rules, in order:
1. Unit modules: ``unit_modules=None`` picks every member of a ``ModuleList`` / ``Sequential`` whose
   class repeats among its siblings (the transformer blocks of a GPT). Otherwise the user's classes,
   class names or callable decide. Units do not nest: inside a chosen module, nothing more is chosen.
2. A parameter reachable from two units (tied or shared weights) belongs to the root, which is
   gathered whenever any unit runs.
3. A parameter with fewer than ``persistence_threshold`` elements is *persistent*: kept whole on every
   rank, in one flat group of its own (its gradient and optimizer state are still sharded).
4. Adapters: in a unit that also holds frozen parameters, trainable parameters that together make up
   at most ``ADAPTER_SHARE`` of the unit's elements are persistent too, whatever their size (LoRA's A
   and B beside a frozen base layer). The unit is then frozen whole: it has no gradient shard and is
   never reduce-scattered, where a unit with one trainable parameter reduces all of its elements. The
   adapters' gradients and optimizer state stay sharded; held whole, they cost a few percent of the
   frozen unit, and any rank can read them at once (peft's ``save_pretrained`` does).
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

from torch import nn

from ...config.settings import UnitPolicy
from ...errors import Zero3ConfigError

ROOT = ""  # module path of the root unit
ADAPTER_SHARE = 1 / 8  # most elements of a frozen unit that its trainable parameters may hold to be adapters (rule 4)


@dataclass
class UnitSpec:
    path: str  # module path inside the root ("" for the root itself)
    module: nn.Module
    params: list[tuple[str, nn.Parameter]] = field(default_factory=list)


@dataclass
class UnitPlan:
    units: list[UnitSpec]  # the root first, then the others in module order
    persistent: list[tuple[str, nn.Parameter]]

    @property
    def root(self) -> UnitSpec:
        return self.units[0]


def plan_units(root: nn.Module, policy: UnitPolicy, persistence_threshold: int) -> UnitPlan:
    is_unit = _policy_predicate(policy)
    unit_paths: list[str] = []
    for path, module in root.named_modules():
        if path == ROOT or any(_is_under(path, chosen) for chosen in unit_paths):
            continue
        if is_unit(module, path, root):
            unit_paths.append(path)
    if policy is not None:
        _check_policy_matches(root, policy, [root.get_submodule(p) for p in unit_paths])
    specs = {ROOT: UnitSpec(ROOT, root)}
    for path in unit_paths:
        specs[path] = UnitSpec(path, root.get_submodule(path))

    # owner of every parameter: the unit(s) whose module path contains one of the parameter's paths
    owners: dict[int, set[str]] = {}
    first_name: dict[int, str] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        owner = next((u for u in unit_paths if _is_under(name, u)), ROOT)
        owners.setdefault(id(p), set()).add(owner)
        first_name.setdefault(id(p), name)
        params[id(p)] = p

    persistent: list[tuple[str, nn.Parameter]] = []
    for key, p in params.items():
        name = first_name[key]
        if p.numel() < persistence_threshold:
            persistent.append((name, p))
            continue
        unit_owners = owners[key]
        owner = unit_owners.pop() if len(unit_owners) == 1 else ROOT
        specs[owner].params.append((name, p))
    for spec in specs.values():
        persistent.extend(_take_adapters(spec))
    units = [specs[ROOT]] + [specs[p] for p in unit_paths if specs[p].params]
    return UnitPlan(units=units, persistent=persistent)


def _take_adapters(spec: UnitSpec) -> list[tuple[str, nn.Parameter]]:
    """Remove from ``spec`` the trainable parameters that are adapters of its frozen ones (rule 4)."""
    trainable = [(n, p) for n, p in spec.params if p.requires_grad]
    if not trainable or len(trainable) == len(spec.params):
        return []
    if sum(p.numel() for _, p in trainable) > ADAPTER_SHARE * sum(p.numel() for _, p in spec.params):
        return []
    spec.params = [(n, p) for n, p in spec.params if not p.requires_grad]
    return trainable


def _check_policy_matches(root: nn.Module, policy: UnitPolicy, chosen: list[nn.Module]) -> None:
    """A ``unit_modules`` policy that selects no module would leave the model one root unit, with nothing
    sharded between forward calls: fail, naming the entries and the classes that repeat. Entries that
    match nothing beside others that do (a list written for several architectures) are warned of."""
    if callable(policy) and not isinstance(policy, (list, tuple)):
        unmatched = [getattr(policy, "__name__", repr(policy))] if not chosen else []
    else:
        unmatched = [entry for entry in policy if not any(_matches(m, entry) for m in root.modules())]
    if unmatched and chosen:
        warnings.warn(f"zero3: `unit_modules` entries {unmatched} match no module of {type(root).__name__}; "
                      "the others chose the units.", stacklevel=3)  # fmt: skip
    elif unmatched:
        counts = Counter(type(m).__name__ for m in root.modules() if any(True for _ in m.parameters(recurse=False)) or
                         any(True for _ in m.children()))  # fmt: skip
        repeating = sorted(name for name, n in counts.items() if n >= 2)
        raise Zero3ConfigError(
            f"zero3: `unit_modules` entry {unmatched} matches no module of {type(root).__name__}, so the model would "
            f"run as one unit with nothing sharded between forward calls. Classes that repeat in it: {repeating}; "
            "name one of them (a class or its name), or leave `unit_modules=None` to pick repeated blocks."
        )


def _matches(module: nn.Module, entry: object) -> bool:
    cls = type(module)
    if isinstance(entry, type):
        return isinstance(module, entry)
    return entry in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _is_under(name: str, module_path: str) -> bool:
    return module_path == ROOT or name == module_path or name.startswith(module_path + ".")


def _policy_predicate(policy: UnitPolicy) -> Callable[[nn.Module, str, nn.Module], bool]:
    if policy is None:
        return _repeated_member
    if callable(policy) and not isinstance(policy, (list, tuple)):
        user: Callable[[nn.Module], bool] = policy  # type: ignore[assignment]
        return lambda module, path, root: bool(user(module))
    def by_class(module: nn.Module, path: str, root: nn.Module) -> bool:
        return any(_matches(module, entry) for entry in policy)

    return by_class


def _repeated_member(module: nn.Module, path: str, root: nn.Module) -> bool:
    """True for a member of a ModuleList/Sequential in which its class appears at least twice."""
    parent = _parent_of(root, path)
    if not isinstance(parent, (nn.ModuleList, nn.Sequential)):
        return False
    if not any(True for _ in module.parameters()):
        return False
    counts = Counter(type(m) for m in parent.children() if any(True for _ in m.parameters()))
    return counts[type(module)] >= 2


def _parent_of(root: nn.Module, path: str) -> Optional[nn.Module]:
    parent_path = path.rpartition(".")[0]
    return root.get_submodule(parent_path) if parent_path else root
