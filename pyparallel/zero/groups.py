"""Parameter groups over flat shards: the user's ``torch.optim``-style groups, and the *runs* they become.

A user passes groups exactly as ``torch.optim`` takes them (``[{"params": [...], "weight_decay": 0.0},
...]``, nanoGPT's and the Hugging Face Trainer's decay / no-decay split). The shard engine keeps a rank's
slices of flat groups, not parameters, so a group becomes a list of *runs*: contiguous ranges of the rank's
shard space whose elements all belong to one user group. Inside each flat group the parameters are laid
out grouped by user group (``order_by_group``), so a rank's slice of a flat group holds at most one run per
user group and the optimizer gets a handful of tensors, not one per parameter. Each run is one tensor of
the inner optimizer, in the param_group of its user group; element-wise optimizers (the only ones ZeRO
accepts) update it exactly as they would the parameters' elements.

Padding elements (the flat group's tail past the last parameter) join the run before them: zero weight,
zero gradient and zero state stay zero under every element-wise rule.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch.nn as nn


@dataclass(frozen=True)
class Run:
    """Elements ``[lo, hi)`` of flat group ``g``'s shard slice, all in user group ``k``."""

    g: int
    k: int
    lo: int
    hi: int


def resolve(param_groups, model: nn.Module, optimizer, defaults: dict) -> tuple[list[dict], dict[str, int]]:
    """Validate ``param_groups`` against ``model`` (its own, unwrapped parameters) and ``optimizer``; returns
    (options per group, in order; canonical parameter name -> group index). Parameters in no group get the
    defaults, in one more group after the user's. Raises ValueError naming the offending entry."""
    names = {id(p): n for n, p in model.named_parameters()}
    if param_groups is None:
        return [{}], {}
    if isinstance(param_groups, dict) or not isinstance(param_groups, (list, tuple)):
        raise ValueError(f"param_groups must be a list of dicts, each with a 'params' list, as torch.optim takes "
                         f"them; got {type(param_groups).__name__}")
    options, group_of = [], {}
    for k, group in enumerate(param_groups):
        if not isinstance(group, dict) or "params" not in group:
            raise ValueError(f"param_groups[{k}] must be a dict with a 'params' entry, got {group!r}")
        params = group["params"]
        params = [params] if isinstance(params, nn.Parameter) else list(params)
        for p in params:
            if id(p) not in names:
                shape = tuple(getattr(p, "shape", ()))
                raise ValueError(f"param_groups[{k}] lists a tensor of shape {shape} that is not a parameter of the "
                                 f"model being wrapped (pass the parameters of the unwrapped model)")
            name = names[id(p)]
            if name in group_of:
                raise ValueError(f"parameter '{name}' is listed in param_groups[{group_of[name]}] and "
                                 f"param_groups[{k}]; every parameter may be in at most one group")
            group_of[name] = k
        opts = {key: v for key, v in group.items() if key != "params"}
        _check_options(optimizer, {**defaults, **opts}, f"param_groups[{k}]")
        options.append(opts)
    if any(n not in group_of for n in names.values()):
        options.append({})  # the defaults, for every parameter no group names
    return options, group_of


def _check_options(optimizer, kwargs: dict, where: str) -> None:
    try:
        inspect.signature(optimizer).bind(None, **kwargs)
    except TypeError as exc:
        raise ValueError(f"{where}: options {sorted(kwargs)} do not fit {optimizer.__name__}: {exc}") from None


def group_index(name: str, group_of: dict[str, int], n_groups: int) -> int:
    """The group of parameter ``name`` (the trailing defaults group when no user group names it)."""
    return group_of.get(name, n_groups - 1)


def order_by_group(named: list[tuple[str, nn.Parameter]], group_of: dict[str, int], n_groups: int):
    """``named`` stably sorted by group, so each user group is one contiguous stretch of a flat group."""
    return sorted(named, key=lambda item: group_index(item[0], group_of, n_groups))


def grouped_buckets(named: list[tuple[str, nn.Parameter]], cap_bytes: int, world: int, elem_bytes: int,
                    group_of: dict[str, int], n_groups: int):
    """Gradient buckets (``flat_param.plan_buckets``: formed in backward order, regardless of groups), each
    with its parameters reordered by user group."""
    from pyparallel.zero.flat_param import FlatLayout, plan_buckets

    out = []
    for lay in plan_buckets(named, cap_bytes, world, elem_bytes):
        ordered = order_by_group(list(zip(lay.names, lay.params)), group_of, n_groups)
        out.append(FlatLayout([n for n, _ in ordered], [p for _, p in ordered], world))
    return out


def plan_runs(layouts, rank: int, group_of: dict[str, int], n_groups: int, parts: dict[int, int] | None = None
              ) -> list[Run]:
    """This rank's runs, flat group by flat group (see the module docstring). ``parts``: flat group ->
    which part of the rank's slice it updates, for groups whose slice is shared (``FlatLayout.split``);
    their runs cover that part only (offsets stay relative to the slice's start)."""
    runs: list[Run] = []
    for g, lay in enumerate(layouts):
        base, _ = lay.shard_range(rank)
        a, b = lay.owned_range(rank, parts[g]) if parts and g in parts else lay.shard_range(rank)
        mine: list[Run] = []
        for name, o, n in zip(lay.names, lay.offsets, lay.numels):
            lo, hi = max(a, o), min(b, o + n)
            if lo >= hi:
                continue
            k = group_index(name, group_of, n_groups)
            if mine and mine[-1].k == k and mine[-1].hi == lo - base:
                mine[-1] = Run(g, k, mine[-1].lo, hi - base)
            else:
                mine.append(Run(g, k, lo - base, hi - base))
        covered = mine[-1].hi if mine else a - base
        if covered < b - base:  # padding after the last parameter: joins the run before it
            k = mine[-1].k if mine else group_index(lay.names[-1], group_of, n_groups)
            if mine:
                mine[-1] = Run(g, k, mine[-1].lo, b - base)
            else:
                mine.append(Run(g, k, a - base, b - base))
        runs += mine
    return runs
