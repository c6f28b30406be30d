"""Drop-in tensor parallelism: ``parallelize(model, mesh, plan=None)`` replaces a model's layers, in place,
by the Megatron layers of :mod:`pyparallel.tensor_parallel.layers`, slicing the existing full weights so
the parallel model computes the same function as the original (Shoeybi et al. 2019).

Every rank must hold the same full model (same seed or checkpoint) when it calls ``parallelize``; it does
no communication. Sizes t does not divide are reported before anything changes.
"""

from __future__ import annotations

import fnmatch
import types

import torch
import torch.nn as nn

from pyparallel.tensor_parallel import plans as plans_mod
from pyparallel.tensor_parallel.blocks import ParallelMLP, ParallelSelfAttention
from pyparallel.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from pyparallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    InputCache,
    RowParallelLinear,
    VocabParallelEmbedding,
    linear_weight,
)
from pyparallel.tensor_parallel.mappings import allreduce_grad_hook, gather_from_tp, scatter_to_sequence

_PARALLEL = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


def _resolve(model: nn.Module, styles: dict[str, str]) -> list[tuple[str, str]]:
    """(module name, style) for every module a pattern matches (first matching pattern wins; a module
    inside a matched module is not matched again)."""
    for style in styles.values():
        if style not in plans_mod.STYLES:
            raise ValueError(f"unknown tensor-parallel style {style!r}; styles: {', '.join(plans_mod.STYLES)}")
    chosen: list[tuple[str, str]] = []
    for name, _ in model.named_modules():
        if not name or any(name.startswith(c + ".") for c, s in chosen if s != "replicate"):
            continue
        for pattern, style in styles.items():
            if fnmatch.fnmatchcase(name, pattern):
                chosen.append((name, style))
                break
    return chosen


def _check_module(name: str, module: nn.Module, style: str, t: int) -> None:
    """Divisibility of what ``style`` splits in ``module``, before anything is replaced."""
    def need(value: int, what: str) -> None:
        if value % t:
            raise ValueError(f"{name}: {what} ({value}) is not divisible by the tensor-parallel degree tp={t}; "
                             f"choose a tp that divides {value}")

    if style in ("column", "column_gather", "vocab_head"):
        need(linear_weight(module)[0].shape[0], "output features")
    elif style == "qkv":
        out = linear_weight(module)[0].shape[0]
        if out % 3:
            raise ValueError(f"{name}: a fused QKV layer needs 3 equal sections, got {out} output features")
        need(out // 3, "q/k/v width")
    elif style == "attention":
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not hasattr(module, proj):
                raise ValueError(f"{name}: style 'attention' needs q_proj, k_proj, v_proj and o_proj; "
                                 f"{type(module).__name__} has no {proj}")
        d = getattr(module, "head_dim", None)
        if not isinstance(d, int):
            raise ValueError(f"{name}: style 'attention' needs an integer head_dim attribute")
        heads, kv = module.q_proj.out_features // d, module.k_proj.out_features // d
        need(heads, "attention heads")
        need(kv, "key/value heads")
    elif style == "row":
        need(linear_weight(module)[0].shape[1], "input features")
    elif style == "vocab":
        if not isinstance(module, nn.Embedding):
            raise ValueError(f"{name}: style 'vocab' needs nn.Embedding, got {type(module).__name__}")
        need(module.num_embeddings, "vocabulary size")


class _Builder:
    """Carries what replacements share: the mesh, the input caches, embedding shards for tied heads."""

    def __init__(self, model, mesh, plan: plans_mod.ModelPlan, sequence_parallel: bool):
        self.model, self.mesh, self.plan, self.sp = model, mesh, plan, sequence_parallel
        self.cache = InputCache()  # q/k/v (or gate/up) read the same tensor: one f per block
        self.shards: dict[int, nn.Parameter] = {}  # id(original embedding weight) -> its vocab shard
        self.heads: list[ColumnParallelLinear] = []

    def build(self, name: str, module: nn.Module, style: str) -> nn.Module | None:
        mesh, sp = self.mesh, self.sp
        if style == "vocab":
            new = VocabParallelEmbedding.from_embedding(module, mesh, name=name)
            self.shards[id(module.weight)] = new.weight
            return new
        if style in ("column", "column_gather", "qkv", "vocab_head"):
            sections = (linear_weight(module)[0].shape[0] // 3,) * 3 if style == "qkv" else None
            tied = self.shards.get(id(getattr(module, "weight", None)))
            new = ColumnParallelLinear.from_linear(module, mesh, name=name, sections=sections,
                                                   gather_output=style == "column_gather", sequence_parallel=sp,
                                                   input_cache=self.cache)
            if tied is not None:  # the head shares the vocab-parallel embedding's shard: the tie survives
                if tied.shape != new.weight.shape:
                    raise ValueError(f"{name}: tied to an embedding shard of shape {tuple(tied.shape)}, but its "
                                     f"own shard is {tuple(new.weight.shape)}")
                new.weight = tied
            if style == "vocab_head":
                self.heads.append(new)
            return new
        if style == "row":
            return RowParallelLinear.from_linear(module, mesh, name=name, sequence_parallel=sp)
        if style == "attention":
            return ParallelSelfAttention.from_module(module, mesh, sequence_parallel=sp, name=name)
        if style == "gelu_mlp":
            names, approximate = _mlp_layout(name, module, self.plan)
            return ParallelMLP.from_module(module, mesh, names=names, approximate=approximate,
                                           sequence_parallel=sp, input_cache=self.cache, name=name)
        return None  # replicate


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


def parallelize(model: nn.Module, mesh, plan: dict[str, str] | None = None, *, sequence_parallel: bool = False,
                attention_fixes: dict | None = None) -> nn.Module:
    """Replace ``model``'s layers by tensor-parallel ones over ``mesh.tp_group``, in place; returns ``model``.

    ``plan`` maps module-name patterns to styles (see :mod:`pyparallel.tensor_parallel.plans`); None picks
    the built-in plan for the built-in GPT, Hugging Face GPT-2 or LLaMA-family models. With a
    ``"vocab_head"`` the logits stay split by vocabulary and the loss is the vocabulary-parallel
    cross-entropy (built-in GPT: ``model(idx, targets)``; Hugging Face: ``model(..., labels=...)``, whose
    ``.logits`` are then this rank's vocabulary slice; without targets/labels the logits are gathered).
    ``sequence_parallel`` (Korthikanti et al. 2022) is supported for the built-in GPT.
    ``attention_fixes`` maps attention class names to ``fn(module, tp, name)`` that adjust head counts."""
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
    chosen = _resolve(model, mplan.styles)
    for name, style in chosen:
        _check_module(name, model.get_submodule(name), style, t)
    fixes = dict(plans_mod.ATTENTION_FIXES, **(attention_fixes or {}))
    attention = {name.rpartition(".")[0] for name, style in chosen if style in ("column", "qkv")}
    for parent in sorted(attention):  # refuse unknown attention modules before changing anything
        plans_mod.check_attention(model.get_submodule(parent), parent, t, fixes)
    _check_ties(model, chosen)

    builder = _Builder(model, mesh, mplan, sequence_parallel)
    # Embeddings first, so that a tied head finds its embedding's shard.
    for name, style in sorted(chosen, key=lambda c: c[1] != "vocab"):
        new = builder.build(name, model.get_submodule(name), style)
        if new is not None:
            _set_module(model, name, new)
    for parent in sorted(attention):
        module = model.get_submodule(parent)
        fix = fixes.get(type(module).__name__)
        if fix is not None and t > 1:
            fix(module, t, parent)
    if builder.heads:
        _wire_loss(model, mesh, mplan, builder)
    if sequence_parallel:
        _wire_sequence_parallel(model, mesh)
    # The shared input cache only matters within one forward: drop its entry afterwards.
    model.register_forward_hook(lambda module, args, output: builder.cache.clear())
    model._pyparallel_tp = {"mesh": mesh, "plan": mplan, "sequence_parallel": sequence_parallel}
    return model


def _check_ties(model: nn.Module, chosen: list[tuple[str, str]]) -> None:
    """A parameter shared between a module the plan splits and one it leaves whole would silently stop
    being shared: refuse it (a tied LM head must be 'vocab_head' when its embedding is 'vocab')."""
    split = [n for n, s in chosen if s != "replicate"]

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


def _wire_loss(model, mesh, mplan, builder) -> None:
    group = mesh.tp_group
    head = builder.heads[0]
    if mplan.family == "gpt":
        model._tp_group = group
        model.forward = types.MethodType(_gpt_tp_forward, model)
        return
    # Hugging Face: with labels, keep the logits split and compute the loss on them; without, gather.
    def loss_function(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
                      shift_labels=None, **kwargs):
        split = head.out_features != logits.shape[-1]  # labels passed positionally: the head gathered
        return causal_lm_loss(logits, labels, group if split else None, num_items_in_batch, ignore_index,
                              shift_labels)

    def pre_hook(module, args, kwargs):
        head.gather_output = kwargs.get("labels") is None
        return None

    model.loss_function = loss_function
    model.register_forward_pre_hook(pre_hook, with_kwargs=True)


def causal_lm_loss(logits, labels, group, num_items_in_batch=None, ignore_index=-100, shift_labels=None):
    """transformers' ForCausalLMLoss on vocabulary-split logits (``group`` = the TP group; None for full
    logits): shift, at least fp32, mean (or sum / items)."""
    if shift_labels is None:
        labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    reduction = "sum" if num_items_in_batch is not None else "mean"
    logits = logits if logits.dtype == torch.float64 else logits.float()
    shift_labels = shift_labels.to(logits.device)
    if group is None:  # full logits
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), shift_labels.reshape(-1),
                                           ignore_index=ignore_index, reduction=reduction)
    else:
        loss = vocab_parallel_cross_entropy(logits, shift_labels, group, ignore_index=ignore_index,
                                            reduction=reduction)
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
        return gather_from_tp(logits, self._tp_group, -1)
    return vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(), self._tp_group)


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
                p.register_hook(allreduce_grad_hook(group))


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
