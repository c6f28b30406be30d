"""Drop-in tensor parallelism: ``parallelize(model, mesh, plan=None)`` replaces a model's layers, in place,
by the Megatron layers of :mod:`pyparallel.tensor_parallel.layers`, slicing the existing full weights so
the parallel model computes the same function as the original (Shoeybi et al. 2019).

Every rank must hold the same full model (same seed or checkpoint) when it calls ``parallelize``, or the same
model on the meta device, whose shards then come from ``weights=`` or ``init=``; it does no communication.
Sizes t does not divide are reported before anything changes.
"""

from __future__ import annotations

import fnmatch
import types

import torch
import torch.nn as nn

from pyparallel.data.tokens import check_token_ids
from pyparallel.source import self_reads
from pyparallel.tensor_parallel import plans as plans_mod
from pyparallel.tensor_parallel import random as tp_random
from pyparallel.tensor_parallel import styles as styles_mod
from pyparallel.tensor_parallel.cross_entropy import _cross_entropy, vocab_parallel_cross_entropy
from pyparallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    InputCache,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pyparallel.tensor_parallel.mappings import gather_from_tp, register_allreduce_grad_hook, scatter_to_sequence

_PARALLEL = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


def _resolve(model: nn.Module, styles: dict) -> list[tuple[str, styles_mod.Style]]:
    """(module name, style) for every module a pattern matches (first matching pattern wins; a module
    inside a matched module is not matched again)."""
    resolved = {pattern: styles_mod.get(style) for pattern, style in styles.items()}
    chosen: list[tuple[str, styles_mod.Style]] = []
    for name, _ in model.named_modules():
        if not name or any(name.startswith(c + ".") for c, s in chosen if s.name != "replicate"):
            continue
        for pattern, style in resolved.items():
            if fnmatch.fnmatchcase(name, pattern):
                chosen.append((name, style))
                break
    return chosen


def _check_rows(chosen: list[tuple[str, styles_mod.Style]]) -> None:
    """A row-parallel layer needs its input split by features: a column-like sibling in the same parent
    (o_proj beside q/k/v, down_proj beside gate/up). Without one its input would be whole (a plan matched by
    names on a model whose other layers it does not cover, e.g. LLaMA's on Phi-3)."""
    splitting = {name.rpartition(".")[0] for name, s in chosen if s.splits_input}
    for name, style in chosen:
        if style.name == "row" and name.rpartition(".")[0] not in splitting:
            raise ValueError(f"{name}: style 'row' needs its input split by features, but no layer beside it in "
                             f"{name.rpartition('.')[0] or 'the model'} is column-split by the plan; split the layer "
                             f"that feeds it ('column', 'gate_up', 'fused_qkv', ...) or use 'replicate'")


_MLP_NAMES = (("fc_in", "fc_out"), ("c_fc", "c_proj"), ("fc1", "fc2"), ("dense_h_to_4h", "dense_4h_to_h"))
_GELU_CLASSES = {"NewGELUActivation": "tanh", "GELUTanh": "tanh", "PytorchGELUTanh": "tanh",
                 "FastGELUActivation": "tanh", "GELUActivation": "none", "GELU": None}


def _mlp_layout(name: str, module: nn.Module, plan: plans_mod.ModelPlan) -> tuple[tuple[str, str], str]:
    """The two linear layers' attribute names and the GeLU form of an MLP the plan calls 'gelu_mlp'."""
    pairs = [plan.mlp_names] + [p for p in _MLP_NAMES if p != plan.mlp_names]
    names = next((p for p in pairs if all(hasattr(module, a) for a in p)), None)
    if names is None:
        raise ValueError(f"{name}: style 'gelu_mlp' needs two linear layers named one of {list(_MLP_NAMES)}; "
                         f"{type(module).__name__} has none of them")
    approximate = getattr(module, "approximate", None)
    act = getattr(module, "act", None)
    if approximate is None and act is not None:
        cls = type(act).__name__
        if cls not in _GELU_CLASSES:
            raise ValueError(f"{name}: activation {cls} is not a GeLU the fused MLP computes; use 'column' and "
                             f"'row' for {names[0]} and {names[1]} instead of 'gelu_mlp'")
        approximate = _GELU_CLASSES[cls] or getattr(act, "approximate", "none")
    if approximate is None:
        approximate = plan.gelu
    return names, approximate


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)


def parallelize(model: nn.Module, mesh, plan: dict | None = None, *, sequence_parallel: bool = False,
                attention_fixes: dict | None = None, vocab_multiple: int | None = 64, weights=None,
                init=None) -> nn.Module:
    """Replace ``model``'s layers by tensor-parallel ones over ``mesh.tp_group``, in place; returns ``model``.
    The splitting (plans, styles, vocabulary padding, sequence parallelism): see :func:`split`.

    A model built on the meta device (``with torch.device("meta"): ...``) is split while still on meta, then
    this rank's shards get storage and values: from ``weights`` (a safetensors file or Hugging Face folder,
    the model's own names; each rank reads only its rows / columns of each tensor, each section of a fused
    'qkv' layer separately, through ``safe_open.get_slice``) or, without weights, by ``init(name, module)``
    (default: the model's ``init_module``, else each module's ``reset_parameters()``) run on one full-size
    module at a time under ``materialize.seed_of(name)``, keeping this rank's slices: the same shards as
    initialising the whole model in one process and splitting it. Missing, unexpected or mis-shaped tensors
    are a ValueError naming them before anything changes. Vocabulary padding rows stay zero; meta buffers
    (rotary ``inv_freq``) are rebuilt. ``weights`` also loads into a model with real tensors (after the
    split)."""
    from pyparallel import materialize

    reader = None  # (a model with real tensors: split as it is, and the mesh needs no device)
    if weights is not None or init is not None or materialize.has_meta(model):
        reader = materialize.open_source(model, mesh.device, weights, init)  # checked before anything changes
    buffers = materialize.loadable(model, reader)
    split(model, mesh, plan, sequence_parallel=sequence_parallel, attention_fixes=attention_fixes,
          vocab_multiple=vocab_multiple)
    if reader is not None:
        materialize.rebuild_buffers(model, mesh.device, buffers)
        materialize.load_in_place(model, reader, mesh.device)
    return model


def split(model: nn.Module, mesh, plan: dict | None = None, *, sequence_parallel: bool = False,
          attention_fixes: dict | None = None, vocab_multiple: int | None = 64) -> nn.Module:
    """Replace ``model``'s layers by tensor-parallel ones over ``mesh.tp_group``, in place; returns ``model``.
    Tensors on the meta device stay there (their shards too): :func:`parallelize` and the other wrappers
    give them values.

    ``plan`` maps module-name patterns to styles (names or ``Style`` objects, see
    :mod:`pyparallel.tensor_parallel.plans`); None picks the built-in plan for the built-in GPT, Hugging Face
    GPT-2, LLaMA, Mistral, Qwen2/3, Phi-3 or Gemma 1/2. Every style checks its module first and refuses what
    it cannot split exactly. With a ``"vocab_head"`` the logits stay split by vocabulary and the loss is the
    vocabulary-parallel cross-entropy (built-in GPT: ``model(idx, targets)``; Hugging Face:
    ``model(..., labels=...)``, whose ``.logits`` are then this rank's vocabulary slice; without
    targets/labels, or when the forward does not compute its loss through ``self.loss_function``, the
    logits are gathered). A vocabulary t does not divide is padded to a multiple of
    ``t * vocab_multiple`` (Megatron's ``make-vocab-size-divisible-by``; None refuses it instead): the padded
    logits are -inf and the padded rows are never saved. ``sequence_parallel`` (Korthikanti et al. 2022) is
    supported for the built-in GPT. ``attention_fixes`` maps attention class names to ``fn(module, tp, name)``
    that adjust head counts."""
    t = mesh.tp_group.size
    detected = plans_mod.detect(model)
    if plan is None:
        if detected is None:
            raise ValueError(f"no built-in tensor-parallel plan for {type(model).__name__}; pass "
                             f"plan={{'module.name.pattern': 'column' | 'row' | 'vocab' | ...}}")
        mplan = detected
    else:
        mplan = plans_mod.ModelPlan("custom", dict(plan))
        if detected is not None:
            mplan.mlp_names, mplan.gelu, mplan.sizes = detected.mlp_names, detected.gelu, detected.sizes
            mplan.family = detected.family
    if sequence_parallel and mplan.family != "gpt":
        raise ValueError(f"sequence_parallel is supported for the built-in GPT only, not for a {mplan.family} "
                         f"model (its position ids and attention masks are computed from the full sequence)")
    plans_mod.check_sizes(mplan, t)
    cache = InputCache()  # q/k/v (or gate/up) read the same tensor: one f per block
    ctx = styles_mod.Context(model, mesh, mplan, sequence_parallel=sequence_parallel, vocab_multiple=vocab_multiple,
                             cache=cache)
    chosen = _resolve(model, mplan.styles)
    for name, style in chosen:
        style.check(name, model.get_submodule(name), ctx)
    _check_rows(chosen)
    fixes = dict(plans_mod.ATTENTION_FIXES, **(attention_fixes or {}))
    attention = {name.rpartition(".")[0] for name, style in chosen if style.column_split}
    for parent in sorted(attention):  # refuse unknown attention modules before changing anything
        split = tuple(n[len(parent) + 1:] if parent else n for n, s in chosen
                      if s.name != "replicate" and n.startswith(parent + "." if parent else ""))
        plans_mod.check_attention(model.get_submodule(parent), parent, t, fixes, split)
        if t > 1:
            tp_random.check_split_module(model.get_submodule(parent), parent)
    _check_ties(model, chosen)

    # Embeddings first, so that a tied head finds its embedding's shard.
    for name, style in sorted(chosen, key=lambda c: not isinstance(c[1], styles_mod.Vocab)):
        new = style.build(name, model.get_submodule(name), ctx)
        if new is not None:
            _set_module(model, name, new)
    for parent in sorted(attention):
        module = model.get_submodule(parent)
        fix = fixes.get(type(module).__name__)
        if fix is not None and t > 1:
            fix(module, t, parent)
        plans_mod.verify_fixed(module, parent, t, getattr(model, "config", None))
        if t > 1:  # dropout on this rank's heads draws from its own stream (tensor_parallel/random.py)
            tp_random.fork_module(module, tp_random.tracker(mesh))
    if ctx.heads:
        _wire_loss(model, mesh, mplan, ctx)
    if sequence_parallel:
        _wire_sequence_parallel(model, mesh)
    # The shared input cache only matters within one forward: drop its entry afterwards.
    model.register_forward_hook(lambda module, args, output: cache.clear())
    vocab = ctx.heads[0].valid_out if ctx.heads else None
    model._pyparallel_tp = {"mesh": mesh, "plan": mplan, "sequence_parallel": sequence_parallel,
                            "vocab_size": vocab, "padded_vocab_size": ctx.heads[0].out_features if ctx.heads else None}
    return model


def _check_ties(model: nn.Module, chosen: list[tuple[str, str]]) -> None:
    """A parameter shared between a module the plan splits and one it leaves whole would silently stop
    being shared: refuse it (a tied LM head must be 'vocab_head' when its embedding is 'vocab')."""
    split = [n for n, s in chosen if s.name != "replicate"]

    def covered(name: str) -> bool:
        return any(name == c or name.startswith(c + ".") for c in split)

    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(f"{name}.{pname}" if name else pname)
    for names in owners.values():
        inside = [n for n in names if covered(n.rpartition(".")[0])]
        outside = [n for n in names if not covered(n.rpartition(".")[0])]
        if inside and outside:
            raise ValueError(f"{outside[0]} is tied to {inside[0]}, which the plan splits; give "
                             f"{outside[0].rpartition('.')[0]} a matching style (e.g. 'vocab_head')")


def _wire_loss(model, mesh, mplan, ctx) -> None:
    group = mesh.tp_group
    head = ctx.heads[0]
    if mplan.family == "gpt":
        model._tp_group = group
        model.forward = types.MethodType(_gpt_tp_forward, model)
        return
    # Hugging Face: with labels, keep the logits split and compute the loss on them; without, gather. A forward
    # that computes its loss some other way than through self.loss_function gets whole logits either way (its
    # own loss on split ones would be another loss).
    uses_loss_function = "loss_function" in (self_reads(type(model)) or ())

    def loss_function(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
                      shift_labels=None, **kwargs):
        split = group.size > 1 and logits.shape[-1] == head.weight.shape[0]  # else: the head gathered
        return causal_lm_loss(logits, labels, group if split else None, num_items_in_batch, ignore_index,
                              shift_labels, vocab_size=head.valid_out)

    head_name = next(n for n, m in model.named_modules() if m is head)

    def pre_hook(module, args, kwargs):
        # The head of the model being called: a deep copy of the model (the pipeline's meta-device trace of
        # its forward) has its own, and must not switch this one.
        module.get_submodule(head_name).gather_output = kwargs.get("labels") is None or not uses_loss_function
        return None

    model.loss_function = loss_function
    model.register_forward_pre_hook(pre_hook, with_kwargs=True)


def causal_lm_loss(logits, labels, group, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                   vocab_size=None):
    """transformers' ForCausalLMLoss on vocabulary-split logits (``group`` = the TP group; None for full
    logits): shift, at least fp32, mean (or sum / items). ``vocab_size``: the real vocabulary of padded
    split logits."""
    shifted = shift_labels is None
    if shifted:
        labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    reduction = "sum" if num_items_in_batch is not None else "mean"
    logits = logits if logits.dtype == torch.float64 else logits.float()
    shift_labels = shift_labels.to(logits.device)
    if group is None:  # full logits
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), shift_labels.reshape(-1),
                                           ignore_index=ignore_index, reduction=reduction)
    else:  # the targets the loss reads, checked (labels[..., 0] is never one); positions in the labels given
        vocab = vocab_size if vocab_size is not None else logits.shape[-1] * group.size
        check_token_ids(shift_labels, vocab, "label" if shifted else "shift_labels", ignore_index=ignore_index,
                        shift=1 if shifted else 0)
        loss = _cross_entropy(logits, shift_labels, group, ignore_index, reduction, vocab_size)
    if num_items_in_batch is not None:
        loss = loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch)
                       else num_items_in_batch)
    return loss


def _gpt_tp_forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
    """The built-in GPT's forward with a vocabulary-split head: the loss never gathers the logits."""
    x = self.embed(idx)
    for block in self.blocks:
        x = block(x)
    logits = self.head(x)  # [b, s, V/t]
    if targets is None:
        return gather_from_tp(logits, self._tp_group, -1)[..., :self.head.lm_head.valid_out]
    return vocab_parallel_cross_entropy(logits, targets, self._tp_group,  # [b, s, V/t], [b, s]: the same mean
                                        vocab_size=self.head.lm_head.valid_out)


def _wire_sequence_parallel(model, mesh) -> None:
    """Built-in GPT: split the residual stream along the sequence after the embedding; LayerNorms then see
    1/t of the tokens, so their gradients are summed over the TP group."""
    group = mesh.tp_group

    def scatter(module, args, output):
        return scatter_to_sequence(output, group, 1)

    model.embed.register_forward_hook(scatter)
    for name, module in model.named_modules():
        if isinstance(module, nn.LayerNorm) and (name.startswith("blocks.") or name.startswith("head.")):
            for p in module.parameters():
                register_allreduce_grad_hook(p, group)  # frozen ones too: they may be unfrozen later


def full_parameters(model: nn.Module, grad: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or with ``grad``, its gradient) of a parallelized model, gathered back to the full
    tensor in the original layout and name (a collective over the TP group: every rank must call it)."""
    owners: dict[int, tuple[nn.Module, str]] = {}
    for module in model.modules():
        if isinstance(module, _PARALLEL):
            for pname, p in module.named_parameters(recurse=False):
                owners.setdefault(id(p), (module, pname))
    gathered: dict[int, dict[str, torch.Tensor]] = {}
    out = {}
    for name, p in model.named_parameters():
        if id(p) in owners:
            module, pname = owners[id(p)]
            if id(module) not in gathered:
                gathered[id(module)] = module.full_parameters(grad)
            out[name] = gathered[id(module)][pname]
        elif grad:
            out[name] = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        else:
            out[name] = p.detach().clone()
    return out
