"""Hugging Face causal LMs (LLaMA, GPT-2 and their relatives) as a list of one-tensor-in, one-tensor-out
blocks: ``[embedding, *decoder layers, final norm + LM head]``.

A decoder layer needs more than the hidden states: a causal mask, and for rotary models the position
ids and (cos, sin) tables. Those depend only on the sequence length and on the batch's padding mask, so
each wrapped layer rebuilds them from its input (and the micro-batch's ``attention_mask``, which every
stage slices from the batch it was given) instead of shipping them between stages (the rotary module
holds no parameters, only an ``inv_freq`` buffer, and is shared by the wrappers). Positions are
``0..seq-1`` whatever the padding, as in the Hugging Face models' own forward when no ``position_ids``
are passed. No KV cache: this is the training path.

The blocks are only the model if nothing else happens around them. The causal LM's and its base model's
``forward`` are read (:func:`pyparallel.source.self_reads`): every attribute of ``self`` they read must be
one the blocks stand for (the embedding, layers, norm, head, rotary tables, masks), one they reproduce
(below), or a switch that is off (Gemma 3's bidirectional attention, an MoE router's auxiliary loss), and
the layers may be given only what the wrapped layers rebuild (:func:`pyparallel.source.layer_calls`);
anything else refuses the model with a ValueError naming it, rather than training a different model
without a word. Reproduced, with the meaning these reads have in the models that make them: Granite's
embeddings x ``embedding_multiplier`` and logits / ``config.logits_scaling``, Cohere's logits x
``logit_scale``, Starcoder2's dropout of ``embedding_dropout`` on the embeddings, Gemma 2's (and 3's)
final logit soft-capping, and rotary tables per layer type (Gemma 3, OLMo 3).

Names do not say what a forward does with what it reads, so the blocks are then checked by dataflow
(:func:`check_dataflow`): on a meta copy of the model, the causal LM's own forward and the blocks must
apply the same steps to the hidden states between the input ids and the logits.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn

from pyparallel.pipeline_parallel.stage import meta_copy
from pyparallel.pipeline_parallel.trace import DataflowRecorder, stub
from pyparallel.source import layer_calls, self_reads


class HFEmbedding(nn.Module):
    """Token embedding (+ learned positions for GPT-2) (x Granite's embedding multiplier) (+ dropout): the
    first block."""

    def __init__(self, tokens: nn.Module, positions: nn.Module | None, drop: nn.Module | None,
                 multiplier: float | None = None, dropout: float | None = None):
        super().__init__()
        self.tokens, self.positions, self.drop = tokens, positions, drop
        self.multiplier, self.dropout = multiplier, dropout

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids)
        if self.positions is not None:
            x = x + self.positions(torch.arange(ids.shape[1], device=ids.device))
        if self.multiplier is not None:
            x = x * self.multiplier
        if self.dropout:  # Starcoder2's, functional: in the mode of the model's own embedding module, which both
            # model.train()/eval() and the pipeline's reach (this wrapper only the latter)
            x = nn.functional.dropout(x, self.dropout, self.tokens.training)
        return self.drop(x) if self.drop is not None else x


class HFDecoderLayer(nn.Module):
    """One decoder layer; builds its causal mask (with the padding of ``attention_mask``, [batch, seq],
    0 = padding) and rotary tables from its input, as the Hugging Face model's forward does."""

    takes_attention_mask = True  # Chunk.forward gives it the micro-batch's mask

    def __init__(self, layer: nn.Module, config, rotary: nn.Module | None, kind: str = "full_attention"):
        super().__init__()
        self.layer = layer
        self.config = config
        self.kind = kind  # "full_attention" or "sliding_attention": which mask the model gives this layer
        # Not a registered submodule: it has no parameters, and registering it in every layer would
        # make it look shared between pipeline stages.
        self.__dict__["rotary"] = rotary
        # Gemma 3 and OLMo 3 keep one rotary table per layer type (other bases or scalings for sliding layers).
        self.typed_rotary = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        make_mask = create_sliding_window_causal_mask if self.kind == "sliding_attention" else create_causal_mask
        pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        # position_ids=None: positions are a plain arange (no packed sequences to detect, which would
        # read tensor values and so fail on the meta device used for shape inference). With a padding
        # mask Hugging Face skips that detection too, so the mask built here is the one its forward builds.
        mask = make_mask(config=self.config, inputs_embeds=x, attention_mask=attention_mask, cache=None,
                         position_ids=None)
        kwargs = {}
        if self.rotary is not None:
            rot = self.rotary if x.device.type != "meta" else _meta_rotary(self.rotary)
            table = rot(x, pos, self.kind) if self.typed_rotary else rot(x, position_ids=pos)
            kwargs = {"position_ids": pos, "position_embeddings": table}
        out = self.layer(x, attention_mask=mask, use_cache=False, **kwargs)
        return out[0] if isinstance(out, tuple) else out


def _meta_rotary(rotary: nn.Module) -> nn.Module:
    import copy

    if all(b.is_meta for b in rotary.buffers()):
        return rotary
    return copy.deepcopy(rotary).to("meta")


class HFHead(nn.Module):
    """Final norm + LM head (x Cohere's logit scale) (/ Granite's logits scaling) (+ Gemma 2's final logit
    soft-capping, cap * tanh(logits / cap)): the last block. Each is element-wise, so it is the same on
    vocabulary-parallel logits."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, softcap: float | None = None,
                 scale: float | None = None, divisor: float | None = None):
        super().__init__()
        self.norm, self.lm_head, self.softcap, self.scale, self.divisor = norm, lm_head, softcap, scale, divisor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(x))  # [b, s, h] @ [h, vocab] -> [b, s, vocab]
        if self.scale is not None:
            logits = logits * self.scale
        if self.divisor is not None:
            logits = logits / self.divisor
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


_MASK_KINDS = ("full_attention", "sliding_attention")


def layer_mask_kinds(config, n_layers: int, reads: set[str]) -> list[str]:
    """Which causal mask each decoder layer gets, as the models' own forwards choose, from what they read
    (``reads``, :func:`check_forwards`): ``config.layer_types`` where the forward reads them and the config
    has them (Gemma 2, Qwen 2/3), else a sliding window for every layer where the forward reads
    ``config.sliding_window`` and it is set (Mistral, Phi-3), else full causal: a key the forward does not
    read (a ``sliding_window`` in a LLaMA config) changes nothing there either. A layer type we do not build
    a mask for is refused: giving it the full causal mask would train another model without a word."""
    types = getattr(config, "layer_types", None) if "config.layer_types" in reads else None
    if types is None:
        slides = "config.sliding_window" in reads and getattr(config, "sliding_window", None) is not None
        return ["sliding_attention" if slides else "full_attention"] * n_layers
    types = list(types)[:n_layers]
    odd = sorted({t for t in types if t not in _MASK_KINDS})
    if odd or len(types) != n_layers:
        raise ValueError(f"cannot pipeline a {type(config).__name__} whose layer_types are {sorted(set(types))} "
                         f"for {n_layers} layers: the pipeline builds only {' and '.join(_MASK_KINDS)} masks")
    return types


# What the causal LM's and its base model's forwards may read from ``self`` around the blocks: the pieces the
# blocks are made of, the mask and rotary inputs the decoder layers rebuild, and output plumbing.
_STANDS_FOR = frozenset({
    "config", "model", "transformer", "lm_head", "loss_function", "vocab_size", "config.vocab_size",
    "embed_tokens", "wte", "wpe", "drop", "layers", "h", "norm", "ln_f", "rotary_emb", "config.num_hidden_layers",
    "config.layer_types", "config.sliding_window", "has_sliding_layers", "gradient_checkpointing", "training",
    "warn_if_padding_and_no_attention_mask", "config.use_cache", "config.output_attentions",
    "config.output_hidden_states", "config.return_dict", "config.use_return_dict"})
# What the base model's forward may hand each decoder layer: the hidden states, then what HFDecoderLayer
# rebuilds (mask, positions, rotary tables), what it turns off (the cache) and GPT-2's cross-attention
# inputs (refused when configured: config.add_cross_attention).
_LAYER_KEYWORDS = frozenset({"attention_mask=", "position_embeddings=", "position_ids=", "cache=",
                             "past_key_values=", "past_key_value=", "use_cache=", "cache_position=",
                             "output_attentions=", "encoder_attention_mask=", "**"})
_LAYER_INPUTS = frozenset({"hidden_states", "self", "cache", "past_key_values", "causal_mask", "attention_mask",
                           "encoder_hidden_states", "cache_position"})
# What the blocks reproduce (HFEmbedding, HFHead).
_REPRODUCED = frozenset({"embedding_multiplier", "embedding_dropout", "logit_scale", "config.logits_scaling",
                         "config.final_logit_softcapping"})
# Reads allowed while the config switch they belong to is off: what the switch turns on, the blocks do not do.
_WHILE_OFF = {"config.use_bidirectional_attention": "use_bidirectional_attention",
              "config.add_cross_attention": "add_cross_attention",
              "config.output_router_logits": "output_router_logits", "num_experts": "output_router_logits",
              "num_experts_per_tok": "output_router_logits", "router_aux_loss_coef": "output_router_logits"}


def check_forwards(model: nn.Module, base: nn.Module, n_layers: int) -> set[str]:
    """Refuse ``model`` (ValueError) when its or its base's forward reads from ``self`` something the blocks
    neither stand for nor reproduce, or runs fewer layers than it holds; returns the reads."""
    config = model.config
    seen: set[str] = set()
    for owner in (model, base):
        cls = type(owner).__name__
        reads = self_reads(type(owner))
        if reads is None:
            raise ValueError(f"cannot pipeline a {type(model).__name__}: the source of {cls}.forward cannot be "
                             f"read, so nothing shows that the pipeline's blocks compute what it computes; pass "
                             f"the model as an nn.Sequential or a list of blocks")
        odd = [r for r in reads if r not in _STANDS_FOR and r not in _REPRODUCED
               and not (r in _WHILE_OFF and not getattr(config, _WHILE_OFF[r], False))]
        if odd:
            on = sorted({_WHILE_OFF[r] for r in odd if r in _WHILE_OFF})
            why = f" (on: config.{', config.'.join(on)})" if on else ""
            raise ValueError(f"cannot pipeline a {type(model).__name__}: {cls}.forward reads "
                             f"{', '.join('self.' + r for r in odd)}{why}, which the pipeline's blocks (embedding, "
                             f"decoder layers, final norm + lm_head) do not reproduce, so the pipelined model "
                             f"would compute something else; pass the model as an nn.Sequential or a list of "
                             f"blocks that does")
        seen |= set(reads)
    calls = layer_calls(type(base))
    if not calls:
        raise ValueError(f"cannot pipeline a {type(model).__name__}: {type(base).__name__}.forward does not call "
                         f"its layers in a loop over self.layers (or self.h), so nothing shows what each layer is "
                         f"given; pass the model as an nn.Sequential or a list of blocks")
    for call in calls:
        extra = sorted({n for arg in call[1:] for n in arg} - _LAYER_KEYWORDS - _LAYER_INPUTS)
        if len(call) == 0 or extra:
            raise ValueError(f"cannot pipeline a {type(model).__name__}: {type(base).__name__}.forward gives its "
                             f"layers {', '.join(extra) or 'no hidden states'}, which the pipeline's decoder layers "
                             f"do not (they rebuild only the mask, positions and rotary tables); pass the model as "
                             f"an nn.Sequential or a list of blocks that does")
    declared = getattr(config, "num_hidden_layers", None)
    if "config.num_hidden_layers" in seen and isinstance(declared, int) and declared < n_layers:
        raise ValueError(f"cannot pipeline a {type(model).__name__}: it holds {n_layers} decoder layers but its "
                         f"forward runs config.num_hidden_layers = {declared} of them")
    return seen


def hf_blocks(model) -> list[nn.Module] | None:
    """The blocks of a Hugging Face causal LM, or None when ``model`` is not one we recognise; ValueError
    when its forward does something around the blocks that they would not (:func:`check_forwards`,
    :func:`check_dataflow`)."""
    blocks = _build(model)
    if blocks is not None:
        check_dataflow(model)
    return blocks


def _takes(fn, name: str) -> bool:
    params = inspect.signature(fn).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _layers_of(base):
    return getattr(base, "layers", None) or getattr(base, "h", None)


# The oldest transformers the HF blocks are tested with: its mask builders take ``cache=`` (5.23 and older
# call it ``past_key_values``), and older forwards read what the blocks do not know.
MIN_TRANSFORMERS = (5, 24)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _check_transformers() -> None:
    version = _transformers_version()
    found = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if found < MIN_TRANSFORMERS:
        raise ValueError(f"pipelining a Hugging Face model needs transformers >= "
                         f"{'.'.join(map(str, MIN_TRANSFORMERS))}, found {version}: pip install -U transformers, "
                         f"or pass the model as an nn.Sequential or a list of blocks")


def _build(model) -> list[nn.Module] | None:
    prefix = getattr(model, "base_model_prefix", None)
    base = getattr(model, prefix, None) if prefix else None
    head = getattr(model, "lm_head", None)
    if base is None or head is None:
        return None
    layers = _layers_of(base)
    tokens = getattr(base, "embed_tokens", None) or getattr(base, "wte", None)
    norm = getattr(base, "norm", None) or getattr(base, "ln_f", None)
    if layers is None or tokens is None or norm is None:
        return None
    _check_transformers()
    config = model.config
    reads = check_forwards(model, base, len(layers))

    def read(owner, attr):  # what the forward multiplies, divides or drops out by, where it reads it
        return getattr(owner, attr.removeprefix("config."), None) if attr in reads else None

    rotary = getattr(base, "rotary_emb", None)
    embed = HFEmbedding(tokens, getattr(base, "wpe", None), getattr(base, "drop", None),
                        read(base, "embedding_multiplier"), read(base, "embedding_dropout"))
    kinds = layer_mask_kinds(config, len(layers), reads)
    wrapped = [HFDecoderLayer(layer, config, rotary, kind) for layer, kind in zip(layers, kinds)]
    head = HFHead(norm, head, read(config, "config.final_logit_softcapping"), read(model, "logit_scale"),
                  read(config, "config.logits_scaling"))
    return [embed, *wrapped, head]


def check_dataflow(model: nn.Module, seq: int = 4) -> None:
    """Refuse ``model`` (ValueError) unless the causal LM's own forward and the pipeline's blocks, run on a
    meta copy of it, apply the same steps to the hidden states on the way from the input ids to the logits
    (:mod:`pyparallel.pipeline_parallel.trace`): the same module calls, in the same order, wired the same
    way, with the same operations and constants between them. This catches what reading the forwards by
    name cannot: a piece called twice (a norm before the layers too), a layer given something computed from
    the hidden states, a constant, a read through a submodule."""
    meta = meta_copy([model])[0]
    base = getattr(meta, meta.base_model_prefix)
    rotary = getattr(base, "rotary_emb", None)
    for layer in _layers_of(base):  # only where a layer sits on the path matters, not what it does inside
        stub(layer, lambda hidden_states, *args, **kwargs: torch.empty_like(hidden_states))
    if rotary is not None:
        stub(rotary, lambda x, *args, **kwargs: (x.new_empty(0), x.new_empty(0)))
    watched = {m: n for n, m in meta.named_modules() if m is not meta and m is not base and m is not rotary}
    blocks = _build(meta)
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    # use_cache: with a cache HF does not look for packed sequences (a data-dependent test on meta)
    cache = {"use_cache": True} if _takes(meta.forward, "use_cache") else {}
    runs = []
    for who in ("its forward", "the pipeline's blocks"):
        rec = DataflowRecorder(watched, opaque=[rotary] if rotary is not None else [])
        try:
            with torch.no_grad(), rec:
                rec.seed(ids)
                if who == "its forward":
                    out = meta(input_ids=ids, **cache)
                    out = out.logits if hasattr(out, "logits") else out[0]
                else:
                    out = ids
                    for block in blocks:
                        out = block(out)
        except Exception as exc:  # noqa: BLE001 - whatever stops the run, the blocks are unverified
            raise ValueError(f"cannot pipeline a {type(model).__name__}: {who} could not run on the meta device "
                             f"({type(exc).__name__}: {exc}), so nothing shows that the pipeline's blocks compute "
                             f"what the model computes; pass the model as an nn.Sequential or a list of "
                             f"blocks") from exc
        runs.append((who, rec.steps + [f"logits = {rec.label(out) or 'not on the path'}"]))
    (_, want), (_, got) = runs
    if want != got:
        k = next(i for i in range(max(len(want), len(got))) if i >= len(want) or i >= len(got) or want[i] != got[i])
        say = lambda steps: f"`{steps[k]}`" if k < len(steps) else "nothing more"  # noqa: E731
        raise ValueError(f"cannot pipeline a {type(model).__name__}: on the way from the input ids (h0) to the "
                         f"logits, step {k + 1} of its forward is {say(want)} where the pipeline's blocks do "
                         f"{say(got)} (its steps: {'; '.join(want)}), so the pipelined model would compute "
                         f"something else; pass the model as an nn.Sequential or a list of blocks that does")
