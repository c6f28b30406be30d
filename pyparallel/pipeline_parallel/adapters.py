"""Hugging Face causal LMs (LLaMA, GPT-2 and their relatives) as a list of one-tensor-in, one-tensor-out
blocks: ``[embedding, *decoder layers, final norm + LM head]``.

A decoder layer needs more than the hidden states: a causal mask, and for rotary models the position
ids and (cos, sin) tables. Those depend only on the sequence length and on the batch's padding mask, so
each wrapped layer rebuilds them from its input (and the micro-batch's ``attention_mask``, which every
stage slices from the batch it was given) instead of shipping them between stages (the rotary module
holds no parameters, only an ``inv_freq`` buffer, and is shared by the wrappers). Positions are
``0..seq-1`` whatever the padding, as in the Hugging Face models' own forward when no ``position_ids``
are passed. No KV cache: this is the training path.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class HFEmbedding(nn.Module):
    """Token embedding (+ learned positions for GPT-2) (+ dropout): the first block."""

    def __init__(self, tokens: nn.Module, positions: nn.Module | None, drop: nn.Module | None):
        super().__init__()
        self.tokens, self.positions, self.drop = tokens, positions, drop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids)
        if self.positions is not None:
            x = x + self.positions(torch.arange(ids.shape[1], device=ids.device))
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
            kwargs = {"position_ids": pos, "position_embeddings": rot(x, position_ids=pos)}
        out = self.layer(x, attention_mask=mask, use_cache=False, **kwargs)
        return out[0] if isinstance(out, tuple) else out


def _meta_rotary(rotary: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(rotary).to("meta")


class HFHead(nn.Module):
    """Final norm + LM head (+ Gemma 2's final logit soft-capping, cap * tanh(logits / cap)): the last block.
    The cap is element-wise, so it is the same on vocabulary-parallel logits."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, softcap: float | None = None):
        super().__init__()
        self.norm, self.lm_head, self.softcap = norm, lm_head, softcap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(x))  # [b, s, h] @ [h, vocab] -> [b, s, vocab]
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


_MASK_KINDS = ("full_attention", "sliding_attention")


def layer_mask_kinds(config, n_layers: int) -> list[str]:
    """Which causal mask each decoder layer gets, as the models' own forwards choose: ``config.layer_types``
    where the config has them (Gemma 2, Qwen 2/3), else a sliding window for every layer when
    ``config.sliding_window`` is set (Mistral, Phi-3), else full causal. A layer type we do not build a
    mask for is refused: giving it the full causal mask would train another model without a word."""
    types = getattr(config, "layer_types", None)
    if types is None:
        kind = "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"
        return [kind] * n_layers
    types = list(types)[:n_layers]
    odd = sorted({t for t in types if t not in _MASK_KINDS})
    if odd or len(types) != n_layers:
        raise ValueError(f"cannot pipeline a {type(config).__name__} whose layer_types are {sorted(set(types))} "
                         f"for {n_layers} layers: the pipeline builds only {' and '.join(_MASK_KINDS)} masks")
    return types


def hf_blocks(model) -> list[nn.Module] | None:
    """The blocks of a Hugging Face causal LM, or None when ``model`` is not one we recognise."""
    prefix = getattr(model, "base_model_prefix", None)
    base = getattr(model, prefix, None) if prefix else None
    head = getattr(model, "lm_head", None)
    if base is None or head is None:
        return None
    layers = getattr(base, "layers", None) or getattr(base, "h", None)
    tokens = getattr(base, "embed_tokens", None) or getattr(base, "wte", None)
    norm = getattr(base, "norm", None) or getattr(base, "ln_f", None)
    if layers is None or tokens is None or norm is None:
        return None
    config = model.config
    rotary = getattr(base, "rotary_emb", None)
    embed = HFEmbedding(tokens, getattr(base, "wpe", None), getattr(base, "drop", None))
    kinds = layer_mask_kinds(config, len(layers))
    wrapped = [HFDecoderLayer(layer, config, rotary, kind) for layer, kind in zip(layers, kinds)]
    return [embed, *wrapped, HFHead(norm, head, getattr(config, "final_logit_softcapping", None))]
