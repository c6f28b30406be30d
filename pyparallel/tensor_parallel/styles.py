"""Tensor-parallel styles: each is an object that checks the module a plan gives it, refuses what it cannot
split exactly (naming the module and what to use instead), and builds the parallel replacement.

A style splits weights the way Megatron-LM does (Shoeybi et al. 2019, §3), and a split is only right if the
module's *behaviour* is the plain one the style assumes. A plan matched by names alone (the LLaMA plan on
Gemma, whose names are LLaMA's) is therefore checked against what the modules do:

* an ``nn.Embedding`` subclass that overrides ``forward`` (Gemma's scaled embedding) is refused by
  ``"vocab"``: a vocabulary-parallel lookup would drop what the subclass adds; ``"scaled_vocab"`` keeps an
  ``embed_scale`` and is checked numerically against the module;
* a linear layer whose output the parent module chunks, splits or slices (Phi-3's ``gate_up_proj`` and
  ``qkv_proj``) is refused by ``"column"``: each rank would cut its own shard in half and pair rows that do not
  belong together; ``"gate_up"`` and ``"fused_qkv"`` split each section separately instead;
* an attention module whose ``forward`` reads head counts from ``self.config`` (Phi-3's) is refused unless
  a fix gives it its own config with the local head counts (see ``plans.ATTENTION_FIXES``).

The parent's ``forward`` is read with :mod:`ast` (:mod:`pyparallel.source`: what it does with
``self.<child>(...)``'s output), so the check covers classes pyparallel has never seen; a false alarm is a
refusal, never a silent wrong model, and ``"column_gather"`` (whose output is whole) or ``"replicate"``
always remain.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pyparallel.source import output_cuts
from pyparallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    linear_weight,
)


def _need(name: str, value: int, what: str, t: int) -> None:
    if value % t:
        raise ValueError(f"{name}: {what} ({value}) is not divisible by the tensor-parallel degree tp={t}; "
                         f"choose a tp that divides {value}")


class Context:
    """What styles share while one model is parallelized: the mesh, the model, the input cache of sibling
    column layers, the embeddings' shards (for tied heads), the vocabulary padding and the heads built."""

    def __init__(self, model: nn.Module, mesh, plan, *, sequence_parallel: bool, vocab_multiple: int | None,
                 cache):
        self.model, self.mesh, self.plan, self.sp = model, mesh, plan, sequence_parallel
        self.t = mesh.tp_group.size
        self.vocab_multiple = vocab_multiple
        self.cache = cache
        self.shards: dict[int, nn.Parameter] = {}  # id(original embedding weight) -> its vocab shard
        self.heads: list[ColumnParallelLinear] = []

    def parent(self, name: str) -> tuple[str, nn.Module]:
        parent = name.rpartition(".")[0]
        return parent, self.model.get_submodule(parent) if parent else self.model

    def padded_vocab(self, vocab: int) -> int:
        from pyparallel.tensor_parallel.layers import padded_vocab_size

        return padded_vocab_size(vocab, self.t, self.vocab_multiple)


class Style:
    """One way to split a module. ``check`` raises ValueError before anything changes; ``build`` returns
    the replacement (None: keep the module)."""

    name = "replicate"
    splits_input = False  # a column-like style: the input of a row layer beside it is split
    column_split = False  # leaves a column-split output in the parent (the parent's attention must fit)

    def check(self, name: str, module: nn.Module, ctx: Context) -> None:
        pass

    def build(self, name: str, module: nn.Module, ctx: Context) -> nn.Module | None:
        return None

    def __repr__(self) -> str:
        return f"<tensor-parallel style {self.name!r}>"


class Replicate(Style):
    name = "replicate"


class Column(Style):
    """``ColumnParallelLinear``: output features split; the parent must not cut the output itself."""

    name = "column"
    splits_input = True
    column_split = True
    gather = False

    def sections(self, name: str, module: nn.Module, ctx: Context) -> tuple[int, ...] | None:
        return None

    def check(self, name, module, ctx):
        out = linear_weight(module)[0].shape[0]
        sections = self.sections(name, module, ctx)
        for s in sections or (out,):
            _need(name, s, "output features" if sections is None else f"a section of {s} output features", ctx.t)
        if self.gather or sections is not None:
            return
        parent_name, parent = ctx.parent(name)
        cuts = output_cuts(type(parent), name.rpartition(".")[2])
        if cuts:
            raise ValueError(
                f"{name}: {type(parent).__name__}.forward cuts this layer's output ({', '.join(cuts)}), so a "
                f"column split would give each rank pieces of every section it cuts, paired wrongly; use "
                f"'gate_up' for a fused [gate; up] projection, 'fused_qkv' for a fused [q; k; v] one, "
                f"'column_gather' (whole output) or 'replicate'")

    def build(self, name, module, ctx):
        return ColumnParallelLinear.from_linear(module, ctx.mesh, name=name, sections=self.sections(name, module, ctx),
                                                gather_output=self.gather, sequence_parallel=ctx.sp,
                                                input_cache=ctx.cache)


class ColumnGather(Column):
    name = "column_gather"
    splits_input = False
    column_split = False
    gather = True


class FusedQKV(Column):
    """A fused [q; k; v] projection, each section split by heads so every rank keeps whole heads (and, with
    grouped-query attention, the KV heads of its query groups). ``"qkv"`` has three equal sections (GPT-2's
    ``c_attn``); ``"fused_qkv"`` takes the sizes from the parent attention's ``config`` head counts and
    ``head_dim`` (Phi-3's ``qkv_proj``)."""

    name = "qkv"

    def sections(self, name, module, ctx):
        out = linear_weight(module)[0].shape[0]
        if self.name == "qkv":
            return (out // 3,) * 3
        _, parent = ctx.parent(name)
        cfg, d = getattr(parent, "config", None), getattr(parent, "head_dim", None)
        heads = getattr(cfg, "num_attention_heads", None)
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        if not (isinstance(heads, int) and isinstance(d, int)):
            raise ValueError(f"{name}: style 'fused_qkv' needs the parent attention to have config.num_attention_heads "
                             f"and head_dim; {type(parent).__name__} has not")
        return heads * d, kv * d, kv * d

    def check(self, name, module, ctx):
        out = linear_weight(module)[0].shape[0]
        _, parent = ctx.parent(name)
        if self.name == "qkv":
            cfg = getattr(parent, "config", None)
            heads, kv = getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_key_value_heads", None)
            if kv is not None and heads is not None and kv != heads:
                raise ValueError(f"{name}: {type(parent).__name__} has {heads} query and {kv} key/value heads, so "
                                 f"q, k and v are not equal thirds; use style 'fused_qkv'")
            if out % 3:
                raise ValueError(f"{name}: a fused QKV layer needs 3 equal sections, got {out} output features")
        else:
            sections = self.sections(name, module, ctx)
            if sum(sections) != out:
                raise ValueError(f"{name}: sections {sections} from the config's head counts do not add up to its "
                                 f"{out} output features")
            cfg = parent.config
            _need(name, cfg.num_attention_heads, "attention heads", ctx.t)
            _need(name, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads, "key/value heads",
                  ctx.t)
        super().check(name, module, ctx)


class FusedQKVByConfig(FusedQKV):
    name = "fused_qkv"


class GateUp(Column):
    """A fused [gate; up] projection (Phi-3's ``gate_up_proj``, which the MLP ``chunk(2)``s): each half split
    separately, so every rank holds matching rows of gate and of up and its own ``chunk(2)`` pairs them."""

    name = "gate_up"

    def sections(self, name, module, ctx):
        out = linear_weight(module)[0].shape[0]
        if out % 2:
            raise ValueError(f"{name}: a fused gate/up layer needs 2 equal halves, got {out} output features")
        return (out // 2, out // 2)


class Row(Style):
    """``RowParallelLinear``: input features split; something beside it in the parent must split them."""

    name = "row"

    def check(self, name, module, ctx):
        _need(name, linear_weight(module)[0].shape[1], "input features", ctx.t)

    def build(self, name, module, ctx):
        return RowParallelLinear.from_linear(module, ctx.mesh, name=name, sequence_parallel=ctx.sp)


class Attention(Style):
    """A whole attention module with q_proj/k_proj/v_proj/o_proj and ``head_dim`` -> ParallelSelfAttention
    (causal, the built-in GPT's)."""

    name = "attention"

    def check(self, name, module, ctx):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not hasattr(module, proj):
                raise ValueError(f"{name}: style 'attention' needs q_proj, k_proj, v_proj and o_proj; "
                                 f"{type(module).__name__} has no {proj}")
        d = getattr(module, "head_dim", None)
        if not isinstance(d, int):
            raise ValueError(f"{name}: style 'attention' needs an integer head_dim attribute")
        _need(name, module.q_proj.out_features // d, "attention heads", ctx.t)
        _need(name, module.k_proj.out_features // d, "key/value heads", ctx.t)

    def build(self, name, module, ctx):
        from pyparallel.tensor_parallel.blocks import ParallelSelfAttention

        return ParallelSelfAttention.from_module(module, ctx.mesh, sequence_parallel=ctx.sp, name=name)


class GeluMLP(Style):
    name = "gelu_mlp"

    def check(self, name, module, ctx):
        from pyparallel.tensor_parallel.parallelize import _mlp_layout

        names, _ = _mlp_layout(name, module, ctx.plan)
        _need(name, linear_weight(getattr(module, names[0]))[0].shape[0], "MLP width", ctx.t)

    def build(self, name, module, ctx):
        from pyparallel.tensor_parallel.blocks import ParallelMLP
        from pyparallel.tensor_parallel.parallelize import _mlp_layout

        names, approximate = _mlp_layout(name, module, ctx.plan)
        return ParallelMLP.from_module(module, ctx.mesh, names=names, approximate=approximate,
                                       sequence_parallel=ctx.sp, input_cache=ctx.cache, name=name)


class Vocab(Style):
    """``VocabParallelEmbedding`` for a plain ``nn.Embedding`` (vocabulary padded when t does not divide it)."""

    name = "vocab"
    scaled = False

    def _scale(self, name, module):
        return None

    def check(self, name, module, ctx):
        if not isinstance(module, nn.Embedding):
            raise ValueError(f"{name}: style {self.name!r} needs nn.Embedding, got {type(module).__name__}")
        unsupported = [a for a in ("max_norm", "scale_grad_by_freq", "sparse") if getattr(module, a)]
        if unsupported:
            raise ValueError(f"{name}: a vocabulary-parallel embedding does not implement {unsupported}")
        cls = type(module)
        if not self.scaled and cls.forward is not nn.Embedding.forward:
            hint = ("it has an embed_scale: use style 'scaled_vocab'" if hasattr(module, "embed_scale")
                    else "use 'replicate' for it (and its tied head), or a style that reproduces its forward")
            raise ValueError(f"{name}: {cls.__name__} overrides nn.Embedding.forward, which a vocabulary-parallel "
                             f"lookup would drop; {hint}")
        if self.scaled:
            self._verify_scaled(name, module)
        ctx.padded_vocab(module.num_embeddings)  # refuses a vocabulary padding cannot fit

    def _verify_scaled(self, name, module):
        scale = getattr(module, "embed_scale", None)
        if scale is None:
            raise ValueError(f"{name}: style 'scaled_vocab' needs an embed_scale attribute; "
                             f"{type(module).__name__} has none")
        if module.weight.is_meta:
            return  # nothing to evaluate; the class and its embed_scale are all we can check
        ids = torch.arange(min(module.num_embeddings, 64), device=module.weight.device)
        with torch.no_grad():
            got = module(ids)
            want = F.embedding(ids, module.weight, module.padding_idx) * torch.as_tensor(scale).to(module.weight.dtype)
        if not torch.equal(got, want):
            raise ValueError(f"{name}: {type(module).__name__}.forward is not the lookup times embed_scale that "
                             f"'scaled_vocab' computes; use 'replicate' for it")

    def build(self, name, module, ctx):
        scale = getattr(module, "embed_scale", None) if self.scaled else None
        if torch.is_tensor(scale) and scale.is_meta and isinstance(getattr(module, "scalar_embed_scale", None),
                                                                   (int, float)):
            # a meta model: the value transformers gives the buffer, so the split layer needs no rebuild
            scale = torch.tensor(module.scalar_embed_scale, dtype=scale.dtype)
        new = VocabParallelEmbedding.from_embedding(module, ctx.mesh, name=name, scale=scale,
                                                    padded_size=ctx.padded_vocab(module.num_embeddings))
        if new.embed_scale is not None and new.embed_scale.is_meta and torch.is_tensor(scale) and not scale.is_meta:
            new.embed_scale = scale.to(ctx.mesh.device)
        ctx.shards[id(module.weight)] = new.weight
        return new


class ScaledVocab(Vocab):
    """Gemma's ``GemmaTextScaledWordEmbedding`` (any embedding whose forward is lookup × ``embed_scale``)."""

    name = "scaled_vocab"
    scaled = True


class VocabHead(Column):
    """The LM head split by vocabulary (padded as its embedding), sharing a vocab-parallel embedding's shard
    when tied, with the vocabulary-parallel cross-entropy as the loss."""

    name = "vocab_head"
    splits_input = False
    column_split = False

    def check(self, name, module, ctx):
        out = linear_weight(module)[0].shape[0]
        ctx.padded_vocab(out)

    def build(self, name, module, ctx):
        out = linear_weight(module)[0].shape[0]
        new = ColumnParallelLinear.from_linear(module, ctx.mesh, name=name, padded_out=ctx.padded_vocab(out),
                                               sequence_parallel=ctx.sp, input_cache=ctx.cache)
        tied = ctx.shards.get(id(getattr(module, "weight", None)))
        if tied is not None:  # the head shares the vocab-parallel embedding's shard: the tie survives
            if tied.shape != new.weight.shape:
                raise ValueError(f"{name}: tied to an embedding shard of shape {tuple(tied.shape)}, but its own "
                                 f"shard is {tuple(new.weight.shape)}")
            new.weight = tied
        ctx.heads.append(new)
        return new


STYLES: dict[str, Style] = {s.name: s for s in (
    Column(), ColumnGather(), Row(), FusedQKV(), FusedQKVByConfig(), GateUp(), Attention(), GeluMLP(), Vocab(),
    ScaledVocab(), VocabHead(), Replicate())}


def get(style) -> Style:
    """The style object for a plan entry (a name from :data:`STYLES` or a :class:`Style` instance)."""
    if isinstance(style, Style):
        return style
    if style not in STYLES:
        raise ValueError(f"unknown tensor-parallel style {style!r}; styles: {', '.join(STYLES)}")
    return STYLES[style]
