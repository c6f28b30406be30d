"""What the planner is asked about: the model, the training run and the cluster.

Pure Python and import-light on purpose: ``pyparallel plan`` must start fast and never needs torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

from pyparallel.planner.errors import PlanError

GB = 1e9  # the ZeRO paper's (and the CLI's) gigabyte; GiB are never used in the planner's output


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape, enough to count parameters exactly.

    ``positions`` > 0 means learned position embeddings (GPT-2, GPT-3); 0 means rotary (LLaMA).
    ``gated_mlp`` is SwiGLU (three FFN matrices), ``norm`` is "layernorm" (weight and bias) or "rmsnorm"
    (weight only), ``bias`` says whether the linear layers carry biases. A spec built with
    :meth:`from_params` knows only its parameter count (``layers == 0``): model states can be planned,
    activations and tensor/pipeline parallelism cannot.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    kv_heads: int | None = None
    ffn: int | None = None
    positions: int = 0
    tied: bool = True
    bias: bool = True
    gated_mlp: bool = False
    norm: str = "layernorm"
    default_seq_len: int = 2048
    total_params: int | None = None  # set only by from_params
    head_dim: int | None = None  # per head, when it is not hidden / heads (Gemma, Qwen 3)
    # (token and position embeddings, all layers, final norm + untied head) as counted from the model itself
    # (a config.json that transformers can build on the meta device); None: counted from the shape above.
    counts: tuple[int, int, int] | None = None
    # Each layer's parameters, counted alike: layers differ in a mixture of experts with dense first layers
    # (DeepSeek-V3) or experts every other layer, and a stage or ZeRO-3's gathered unit holds given layers.
    layer_counts: tuple[int, ...] | None = None
    # Fused (flash-style) attention never stores the s×s scores, softmax or its dropout mask: it recomputes
    # them in backward, which is Korthikanti et al.'s "selective" recompute built into the kernel.
    fused_attention: bool = True

    @classmethod
    def from_params(cls, num_params: int, name: str | None = None) -> ModelSpec:
        if num_params <= 0:
            raise PlanError(f"--params must be positive, got {num_params}")
        return cls(name=name or f"{num_params / 1e9:.3g}B-parameter model", layers=0, hidden=0, heads=0,
                   vocab=0, total_params=int(num_params))

    @property
    def has_shape(self) -> bool:
        return self.total_params is None

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def ffn_dim(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        """Width of the queries (and of the attention output): heads x head size, the hidden size unless the
        model sets its own head_dim."""
        return self.heads * self.head_size

    @property
    def kv_dim(self) -> int:
        return self.kv * self.head_size  # grouped-query attention shrinks K and V only

    def _norm_params(self) -> int:
        return 2 * self.hidden if self.norm == "layernorm" else self.hidden

    def layer_params(self) -> int:
        """Weights and biases of one transformer block: attention, MLP and its two norms (counted from the
        model: the mean over its layers)."""
        if self.counts is not None:
            return round(self.counts[1] / self.layers)
        h, f, q, kv_dim = self.hidden, self.ffn_dim, self.q_dim, self.kv_dim
        attn = 2 * h * q + 2 * h * kv_dim  # Q [h, q] and output projection [q, h], K and V [h, kv_dim]
        mats = 3 if self.gated_mlp else 2
        mlp = mats * h * f
        if self.bias:
            attn += q + 2 * kv_dim + h
            mlp += (mats - 1) * f + h
        return attn + mlp + 2 * self._norm_params()

    def layers_params(self, start: int, stop: int) -> int:
        """Parameters of layers ``start..stop-1`` (a pipeline stage's): counted per layer where the model was
        counted, else that many times :meth:`layer_params`."""
        if self.layer_counts is not None:
            return sum(self.layer_counts[start:stop])
        return (stop - start) * self.layer_params()

    def max_layer_params(self) -> int:
        """The largest layer (ZeRO-3 gathers a whole layer at a time)."""
        return max(self.layer_counts) if self.layer_counts else self.layer_params()

    def embedding_params(self) -> int:
        """Token (and learned position) embeddings: what the first pipeline stage holds besides layers."""
        if self.counts is not None:
            return self.counts[0]
        return self.vocab * self.hidden + self.positions * self.hidden

    def head_params(self) -> int:
        """Final norm plus an untied output projection: what the last stage holds besides layers."""
        if self.counts is not None:
            return self.counts[2]
        return self._norm_params() + (0 if self.tied else self.vocab * self.hidden)

    def num_params(self) -> int:
        """Exact parameter count (tied embeddings counted once); GPT-2 small gives 124,439,808."""
        if not self.has_shape:
            return int(self.total_params)
        if self.counts is not None:
            return sum(self.counts)
        return self.embedding_params() + self.layers * self.layer_params() + self.head_params()

    def validate(self) -> ModelSpec:
        if not self.has_shape:
            return self
        for field_name in ("layers", "hidden", "heads", "vocab"):
            if getattr(self, field_name) <= 0:
                raise PlanError(f"model {self.name}: {field_name} must be positive, got "
                                f"{getattr(self, field_name)}")
        if self.head_dim is None and self.hidden % self.heads:
            raise PlanError(f"model {self.name}: hidden size {self.hidden} is not divisible by {self.heads} "
                            f"heads (the head dimension must be an integer); change --hidden or --heads")
        if self.heads % self.kv:
            raise PlanError(f"model {self.name}: {self.heads} attention heads are not divisible by "
                            f"{self.kv} key/value heads; change --kv-heads")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise PlanError(f"model {self.name}: unknown norm {self.norm!r}")
        return self


def _gpt(name, layers, hidden, heads, positions=1024, seq=1024):
    # The GPT-2 / GPT-3 papers' (and Megatron-LM 2021's) attention materializes the scores: unfused.
    return ModelSpec(name, layers, hidden, heads, vocab=50257, positions=positions, default_seq_len=seq,
                     fused_attention=False)


def _llama(name, layers, hidden, heads, ffn, kv_heads=None, seq=2048):
    return ModelSpec(name, layers, hidden, heads, vocab=32000, kv_heads=kv_heads, ffn=ffn, tied=False,
                     bias=False, gated_mlp=True, norm="rmsnorm", default_seq_len=seq)


# GPT-2 shapes from Radford et al. 2019 (as in nanoGPT), GPT-3 175B from Brown et al. 2020, LLaMA 7B/13B
# from Touvron et al. 2023 (2048-token context) and the 70B with grouped-query attention from Llama 2.
MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m for m in (
        _gpt("gpt2-small", 12, 768, 12),
        _gpt("gpt2-medium", 24, 1024, 16),
        _gpt("gpt2-large", 36, 1280, 20),
        _gpt("gpt2-xl", 48, 1600, 25),
        _gpt("gpt3-175b", 96, 12288, 96, positions=2048, seq=2048),
        _llama("llama-7b", 32, 4096, 32, ffn=11008),
        _llama("llama-13b", 40, 5120, 40, ffn=13824),
        _llama("llama-70b", 80, 8192, 64, ffn=28672, kv_heads=8, seq=4096),
    )
}

_ROPE_TYPES = {"llama", "mistral", "mixtral", "qwen2", "gemma", "phi3", "gpt_neox"}


def _first(cfg: dict, *keys, default=None):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def load_hf_config(path: str) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (GPT-2 or LLaMA-style key names)."""
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except OSError as exc:
        raise PlanError(f"cannot read model config {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise PlanError(f"model config {path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(cfg, dict):
        raise PlanError(f"model config {path} must hold a JSON object")
    layers = _first(cfg, "n_layer", "num_hidden_layers", "num_layers")
    hidden = _first(cfg, "n_embd", "hidden_size", "d_model")
    heads = _first(cfg, "n_head", "num_attention_heads")
    vocab = _first(cfg, "vocab_size")
    missing = [k for k, v in (("n_layer/num_hidden_layers", layers), ("n_embd/hidden_size", hidden),
                              ("n_head/num_attention_heads", heads), ("vocab_size", vocab)) if v is None]
    if missing:
        raise PlanError(f"model config {path} lacks {', '.join(missing)}")
    model_type = str(cfg.get("model_type", ""))
    # transformers 5 saves rotary settings as rope_parameters (4.x: rope_theta / rope_scaling)
    rotary = model_type in _ROPE_TYPES or any(k in cfg for k in ("rope_theta", "rope_scaling", "rope_parameters"))
    gated = model_type in _ROPE_TYPES - {"gpt_neox"} or cfg.get("hidden_act") in ("silu", "swiglu")
    positions = 0 if rotary else int(_first(cfg, "n_positions", "max_position_embeddings", default=0))
    seq = int(_first(cfg, "n_positions", "max_position_embeddings", default=2048))
    head_dim = cfg.get("head_dim")
    spec = ModelSpec(
        name=str(cfg.get("_name_or_path") or os.path.basename(os.path.dirname(os.path.abspath(path))) or path),
        layers=int(layers), hidden=int(hidden), heads=int(heads), vocab=int(vocab),
        kv_heads=_first(cfg, "num_key_value_heads"), ffn=_first(cfg, "intermediate_size", "n_inner"),
        positions=positions, tied=bool(cfg.get("tie_word_embeddings", True)),
        bias=bool(_first(cfg, "attention_bias", "bias", default=not gated)), gated_mlp=gated,
        norm="rmsnorm" if "rms_norm_eps" in cfg else "layernorm", default_seq_len=seq,
        head_dim=int(head_dim) if isinstance(head_dim, int) and head_dim * int(heads) != int(hidden) else None,
    ).validate()
    counted = count_with_transformers(cfg)
    if counted is None:
        return spec
    counts, per_layer = counted
    return replace(spec, counts=counts, layer_counts=per_layer if len(per_layer) == spec.layers else None)


def count_with_transformers(cfg: dict) -> tuple[tuple[int, int, int], tuple[int, ...]] | None:
    """((embeddings, all layers, the rest: final norm and an untied head), each layer's count) of the causal
    LM that ``cfg`` describes, counted from transformers' own model class built on the meta device (no memory, nothing
    read or downloaded): exact for every family transformers knows (per-head norms, extra norms, biases,
    experts), where the shape formula of :class:`ModelSpec` knows only the LLaMA and GPT-2 layouts. None
    when torch or transformers is missing or cannot build it (an unknown model_type, remote code): the
    shape formula counts then. Imported only here, so ``pyparallel plan`` with a preset never loads torch."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the plan's output, not the config's warnings
    try:
        config = transformers.AutoConfig.for_model(**cfg)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 (any failure to build: fall back to the shape formula)
        return None
    finally:
        transformers.logging.set_verbosity(verbosity)
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    layers = getattr(base, "layers", None) or getattr(base, "h", None)
    embedding = model.get_input_embeddings()
    if layers is None or embedding is None:
        return None
    total = sum(p.numel() for p in model.parameters())  # a tied head counted once, as the model holds it
    per_layer = tuple(sum(p.numel() for p in layer.parameters()) for layer in layers)
    in_layers = sum(p.numel() for p in layers.parameters())  # a weight shared between layers counted once
    embed = sum(p.numel() for p in embedding.parameters())
    positions = getattr(base, "wpe", None)
    if positions is not None:
        embed += sum(p.numel() for p in positions.parameters())
    return (embed, in_layers, total - embed - in_layers), per_layer


def resolve_model(name_or_path: str) -> ModelSpec:
    """A preset name or a path to a config.json (or to the folder holding one)."""
    if name_or_path in MODEL_PRESETS:
        return MODEL_PRESETS[name_or_path]
    path = name_or_path
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if os.path.isfile(path) or path.endswith(".json"):
        return load_hf_config(path)
    raise PlanError(f"unknown model {name_or_path!r}; known presets: {', '.join(MODEL_PRESETS)} "
                    f"(or pass a config.json path, --layers/--hidden/--heads, or --params)")


RECOMPUTE_CHOICES = ("auto", "none", "selective", "full")
# zb-h1 and zbv are the zero-bubble schedules of Qi et al. 2023/2024 (backward split into B and W).
SCHEDULE_CHOICES = ("1f1b", "gpipe", "interleaved", "zb-h1", "zbv")


@dataclass(frozen=True)
class TrainSpec:
    """One optimizer step: ``global_batch`` sequences of ``seq_len`` tokens.

    ``micro_batch`` None lets the search choose it. ``recompute`` "auto" and ``sequence_parallel`` None
    let the search choose them too (the fastest that fits wins, which is the cheapest recomputation).
    ``efficiency`` None uses the cluster's compute model (GEMM efficiency curve plus memory-bound
    elementwise work, see compute.py); a number replaces that model by one flat fraction of peak FLOP/s.
    ``virtual_stages`` None searches the interleaved schedule's chunks per stage. ``margin`` is the share
    of GPU memory kept free for the caching allocator's fragmentation, the CUDA context and NCCL.
    """

    seq_len: int = 2048
    global_batch: int = 256
    micro_batch: int | None = None
    dtype: str = "bf16"
    optimizer: str = "adam"
    recompute: str = "auto"
    sequence_parallel: bool | None = None
    schedule: str = "1f1b"
    virtual_stages: int | None = 2
    efficiency: float | None = None
    margin: float = 0.10
    bucket_mb: float = 25.0

    def validate(self) -> TrainSpec:
        checks = [
            (self.seq_len > 0, f"--seq-len must be positive, got {self.seq_len}"),
            (self.global_batch > 0, f"--global-batch must be positive, got {self.global_batch}"),
            (self.micro_batch is None or self.micro_batch > 0,
             f"--micro-batch must be positive, got {self.micro_batch}"),
            (self.dtype in ("bf16", "fp16", "fp32"), f"--dtype must be bf16, fp16 or fp32, got {self.dtype}"),
            (self.optimizer in ("adam", "adamw", "sgd"),
             f"--optimizer must be adam, adamw or sgd, got {self.optimizer}"),
            (self.recompute in RECOMPUTE_CHOICES,
             f"--recompute must be one of {', '.join(RECOMPUTE_CHOICES)}, got {self.recompute}"),
            (self.schedule in SCHEDULE_CHOICES,
             f"--schedule must be one of {', '.join(SCHEDULE_CHOICES)}, got {self.schedule}"),
            (self.virtual_stages is None or self.virtual_stages >= 1,
             f"--virtual-stages must be >= 1, got {self.virtual_stages}"),
            (self.efficiency is None or 0 < self.efficiency <= 1,
             f"--efficiency must be in (0, 1], got {self.efficiency}"),
            (0 <= self.margin < 1, f"--margin must be in [0, 1), got {self.margin}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise PlanError(msg)
        return self

    @property
    def tokens(self) -> int:
        return self.seq_len * self.global_batch


@dataclass(frozen=True)
class ClusterSpec:
    """Per-GPU hardware figures. Bandwidths are achievable bus bandwidth per GPU, one direction, GB/s
    (what nccl-tests reports as busbw), not the datasheet's bidirectional link rate."""

    name: str
    gpus_per_node: int
    memory_gb: float
    peak_tflops: float  # dense bf16/fp16 tensor-core peak
    peak_tflops_fp32: float
    intra_bw: float  # NVLink / NVSwitch inside a node
    inter_bw: float  # InfiniBand/RoCE between nodes, per GPU (one NIC per GPU)
    pcie_bw: float = 20.0  # GPU <-> host, for offload
    host_bw: float = 200.0  # host memory bandwidth per node, shared by its GPUs' CPU optimizer steps
    # The compute model (compute.py): a GEMM whose smallest dimension is d runs at
    # peak · gemm_eff · d / (d + gemm_half_dim) (Hockney's r_inf and n_1/2); elementwise work moves bytes
    # at hbm_bw GB/s (0: not modelled).
    gemm_eff: float = 0.5
    gemm_half_dim: float = 0.0
    hbm_bw: float = 0.0
    host_ram_gb: float = 0.0  # host memory per node (0: unknown, not checked)

    def peak_flops(self, dtype: str) -> float:
        return (self.peak_tflops_fp32 if dtype == "fp32" else self.peak_tflops) * 1e12

    def validate(self) -> ClusterSpec:
        for k in ("gpus_per_node", "memory_gb", "peak_tflops", "peak_tflops_fp32", "intra_bw", "inter_bw",
                  "pcie_bw", "host_bw"):
            if getattr(self, k) <= 0:
                raise PlanError(f"cluster {self.name}: {k} must be positive, got {getattr(self, k)}")
        if not 0 < self.gemm_eff <= 1:
            raise PlanError(f"cluster {self.name}: gemm_eff must be in (0, 1], got {self.gemm_eff}")
        for k in ("gemm_half_dim", "hbm_bw", "host_ram_gb"):
            if getattr(self, k) < 0:
                raise PlanError(f"cluster {self.name}: {k} must be >= 0, got {getattr(self, k)}")
        return self


# GEMM efficiency ceiling and half-performance size: fitted once to Narayanan et al. 2021, tables 1 and 2
# (A100; tests/test_planner_published.py, docs/planner.md) and assumed to carry over to Hopper, whose
# cuBLAS reaches a similar share of its dense peak.
GEMM_EFF, GEMM_HALF_DIM = 0.60, 150.0


def _gpu(name, mem, peak, fp32, intra, inter, pcie, host, hbm, ram):
    return ClusterSpec(name, 8, mem, peak, fp32, intra_bw=intra, inter_bw=inter, pcie_bw=pcie, host_bw=host,
                       gemm_eff=GEMM_EFF, gemm_half_dim=GEMM_HALF_DIM, hbm_bw=hbm,
                       host_ram_gb=ram)


# HBM bandwidths from NVIDIA's datasheets (A100 40 GB 1555, 80 GB 2039, H100 SXM 3350, H200 4800 GB/s);
# host RAM per node of the DGX A100 (1 TB / 2 TB) and DGX H100/H200 (2 TB) systems.
CLUSTER_PRESETS: dict[str, ClusterSpec] = {
    c.name: c for c in (
        _gpu("a100-40g", 40, 312, 19.5, 240, 23, 20, 200, 1555, 1000),
        _gpu("a100-80g", 80, 312, 19.5, 240, 23, 20, 200, 2039, 2000),
        _gpu("h100", 80, 989, 67, 360, 45, 40, 300, 3350, 2000),
        _gpu("h200", 141, 989, 67, 360, 45, 40, 300, 4800, 2000),
        # Processes on CPUs with gloo: shared-memory "links" inside a host, 10 GbE between hosts; a flat
        # half of peak (no GEMM-size curve, no elementwise term) until ``plan --calibrate`` measures it.
        ClusterSpec("cpu", 8, 16, 0.1, 0.1, intra_bw=5, inter_bw=1.2, pcie_bw=10, host_bw=20),
    )
}


def resolve_cluster(name: str, **overrides) -> ClusterSpec:
    """A preset name, or a JSON file of ClusterSpec fields (``plan --calibrate ... --save-cluster FILE``)."""
    if name in CLUSTER_PRESETS:
        base = CLUSTER_PRESETS[name]
    elif name.endswith(".json"):
        base = _cluster_file(name)
    else:
        raise PlanError(f"unknown cluster {name!r}; known presets: {', '.join(CLUSTER_PRESETS)} "
                        f"(or a cluster .json file written by `pyparallel plan --calibrate ... --save-cluster`)")
    given = {k: v for k, v in overrides.items() if v is not None}
    return replace(base, **given).validate()


def _cluster_file(path: str) -> ClusterSpec:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise PlanError(f"cannot read cluster file {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise PlanError(f"cluster file {path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    fields = set(ClusterSpec.__dataclass_fields__)
    if not isinstance(data, dict) or not {"name", "gpus_per_node", "memory_gb", "peak_tflops"} <= data.keys():
        raise PlanError(f"cluster file {path} must hold a JSON object with the ClusterSpec fields "
                        f"({', '.join(sorted(fields))})")
    unknown = sorted(set(data) - fields)
    if unknown:
        raise PlanError(f"cluster file {path}: unknown fields {', '.join(unknown)}")
    return ClusterSpec(**data)
