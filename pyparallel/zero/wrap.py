"""Which modules become stage-3 units, and which unit owns each parameter.

A unit is the granularity of stage 3's all-gathers (ZeRO section 5.3: parameters are broadcast "one
layer at a time"): its parameters are materialised just before its forward and freed after it, so peak
parameter memory is the largest unit (plus the one being prefetched), not the model.

Default policy: every transformer block of the built-in GPT plus its ``embed`` and ``head``; for other
models, every child of every top-level ``nn.ModuleList`` (the usual "stack of blocks"). A user policy is a
callable ``(qualified_name, module) -> bool``, a class or tuple of classes (isinstance), or an explicit list
of submodules. Nested units are allowed: a parameter belongs to its innermost unit.

With the default policy, units smaller than an eighth of the largest (a position embedding, a final
LayerNorm) join the root unit (:func:`fold_small_units`); an explicit policy is taken as given.

Parameters that are registered under more than one unit (a tied embedding / LM head: in the GPT,
``lm_head.weight`` *is* ``wte.weight``) or under no unit at all belong to the *root* unit, which stays
gathered from the start of the forward to the end of the backward: it is used by both ends of the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn


@dataclass(eq=False)
class UnitSpec:
    name: str  # qualified module name ("" for the root)
    module: nn.Module | None  # None for the root
    names: list[str] = field(default_factory=list)  # canonical parameter names
    params: list[nn.Parameter] = field(default_factory=list)
    # Every (module, attribute) a parameter is registered under, per parameter (ties have several).
    slots: list[list[tuple[nn.Module, str]]] = field(default_factory=list)


def _gpt_units(root: nn.Module) -> list[nn.Module]:
    from pyparallel.models.gpt import GPT

    out = []
    for m in root.modules():
        if isinstance(m, GPT):
            out += [m.embed, *m.blocks, m.head]
    return out


def _modulelist_units(root: nn.Module) -> list[nn.Module]:
    out, seen = [], set()

    def visit(m):
        for child in m.children():
            if isinstance(child, nn.ModuleList):
                for block in child:
                    if id(block) not in seen and any(True for _ in block.parameters()):
                        seen.add(id(block))
                        out.append(block)
            else:
                visit(child)

    visit(root)
    return out


def select_units(root: nn.Module, wrap_policy) -> list[nn.Module]:
    """The unit modules in registration order (validated: ValueError names a bad policy)."""
    if wrap_policy is None:
        chosen = _gpt_units(root) or _modulelist_units(root)
    elif isinstance(wrap_policy, (list, tuple)) and all(isinstance(m, nn.Module) for m in wrap_policy):
        ids = {id(m) for m in wrap_policy}
        chosen = [m for m in root.modules() if id(m) in ids]
        if len(chosen) != len(ids):
            raise ValueError("wrap_policy lists a module that is not part of the model being wrapped")
    elif isinstance(wrap_policy, type) or (isinstance(wrap_policy, tuple)
                                           and all(isinstance(c, type) for c in wrap_policy)):
        chosen = [m for m in root.modules() if isinstance(m, wrap_policy)]
    elif callable(wrap_policy):
        chosen = [m for name, m in root.named_modules() if name and wrap_policy(name, m)]
    else:
        raise ValueError(f"wrap_policy must be None, a callable (name, module) -> bool, a module class (or tuple "
                         f"of classes) or a list of submodules; got {wrap_policy!r}")
    return [m for m in chosen if m is not root]


def assign_parameters(root: nn.Module, unit_modules: list[nn.Module]) -> tuple[UnitSpec, list[UnitSpec]]:
    """Split the trainable parameters of ``root`` into a root unit and one unit per module (units that end up
    without parameters are dropped). Returns ``(root_unit, units)``."""
    unit_of_module: dict[int, int] = {}
    index = {id(m): i for i, m in enumerate(unit_modules)}

    def walk(m, current):
        current = index.get(id(m), current)
        if id(m) in unit_of_module:  # a module reached twice (shared): keep the first owner
            return
        unit_of_module[id(m)] = current
        for child in m.children():
            walk(child, current)

    walk(root, -1)
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    owners: dict[int, set[int]] = {}
    canonical: dict[int, tuple[str, nn.Parameter]] = {}
    for name, p in root.named_parameters():
        canonical[id(p)] = (name, p)
    for _, m in root.named_modules(remove_duplicate=False):
        for attr, p in m._parameters.items():
            if p is None or not p.requires_grad:
                continue
            slots.setdefault(id(p), []).append((m, attr))
            owners.setdefault(id(p), set()).add(unit_of_module.get(id(m), -1))
    root_unit = UnitSpec("", None)
    units = [UnitSpec(_qualname(root, m), m) for m in unit_modules]
    for pid, (name, p) in canonical.items():
        if not p.requires_grad:
            continue
        who = owners[pid]
        target = units[next(iter(who))] if len(who) == 1 and -1 not in who else root_unit
        target.names.append(name)
        target.params.append(p)
        target.slots.append(slots[pid])
    return root_unit, [u for u in units if u.params]


def fold_small_units(root_unit: UnitSpec, units: list[UnitSpec], ratio: int = 8) -> tuple[UnitSpec, list[UnitSpec]]:
    """Move units with fewer than 1/``ratio`` of the largest unit's parameters into the root unit, which is
    gathered once per step and kept. For the default policy: a unit costs three collectives per step (a
    gather for forward, one for backward, a reduce-scatter), and for a position embedding or a final
    LayerNorm their latency outweighs the few bytes that freeing it saves."""
    if not units:
        return root_unit, units
    biggest = max(sum(p.numel() for p in u.params) for u in units)
    kept = []
    for u in units:
        if sum(p.numel() for p in u.params) * ratio < biggest:
            root_unit.names += u.names
            root_unit.params += u.params
            root_unit.slots += u.slots
        else:
            kept.append(u)
    return root_unit, kept


def _qualname(root: nn.Module, module: nn.Module) -> str:
    for name, m in root.named_modules():
        if m is module:
            return name
    return "?"
