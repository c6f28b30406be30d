"""``pyparallel plan``: arguments, their translation into specs, and the run."""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import replace

from pyparallel.planner.errors import PlanError
from pyparallel.planner.search import SearchOptions
from pyparallel.planner.specs import (
    CLUSTER_PRESETS,
    MODEL_PRESETS,
    RECOMPUTE_CHOICES,
    SCHEDULE_CHOICES,
    ModelSpec,
    TrainSpec,
    resolve_cluster,
    resolve_model,
)

_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> int:
    """'124M', '7.5B', '7.5e9', '1T' -> an integer count."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (try 124M, 7.5B or 7.5e9)")
    return int(round(float(match.group(1)) * _SUFFIX[match.group(2).lower()]))


def _stages(text: str) -> tuple[int, ...]:
    try:
        return tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--zero takes a comma list of stages, e.g. 0,1,2,3; got {text!r}") \
            from None


def _cluster_name(text: str) -> str:
    if text in CLUSTER_PRESETS or text.endswith(".json"):
        return text
    raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(CLUSTER_PRESETS)}, "
                                     f"or a cluster .json file)")


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (a preset or config.json, explicit sizes, or a parameter count)")
    g.add_argument("--model", help=f"preset ({', '.join(MODEL_PRESETS)}) or a Hugging Face config.json path")
    g.add_argument("--params", type=parse_count, help="parameter count only (e.g. 7.5B): model states only")
    for name, helptext in (("layers", "transformer layers"), ("hidden", "hidden size"),
                           ("heads", "attention heads"), ("kv-heads", "key/value heads (GQA)"),
                           ("ffn", "FFN size (default 4×hidden)"), ("vocab", "vocabulary size")):
        g.add_argument(f"--{name}", type=int, help=helptext + " (overrides the preset)")
    g.add_argument("--arch", choices=("gpt2", "llama"), default=None,
                   help="layer style for explicit sizes: gpt2 (biases, LayerNorm, learned positions) or "
                        "llama (SwiGLU, RMSNorm, rotary, untied head); default gpt2")
    t = p.add_argument_group("training")
    t.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's context)")
    t.add_argument("--global-batch", type=int, help="sequences per optimizer step (default: 256, "
                   "rounded up to a multiple of --gpus)")
    t.add_argument("--micro-batch", type=int, help="sequences per micro-batch (default: searched)")
    t.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    t.add_argument("--optimizer", choices=("adam", "adamw", "sgd"), default="adam")
    t.add_argument("--recompute", choices=RECOMPUTE_CHOICES, default="auto",
                   help="activation recomputation; auto (default) searches none/selective/full and keeps the "
                        "cheapest that fits")
    t.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                   help="Megatron sequence parallelism with TP (default: searched)")
    t.add_argument("--attention", choices=("fused", "unfused"), default=None,
                   help="fused (flash-style, no s×s scores stored) or unfused attention (default: the "
                        "model's; GPT-2/3 presets unfused, LLaMA and config.json models fused)")
    t.add_argument("--schedule", choices=SCHEDULE_CHOICES, default="1f1b",
                   help="pipeline schedule; zb-h1 and zbv are the zero-bubble schedules of Qi et al.")
    t.add_argument("--virtual-stages", type=int, default=None,
                   help="chunks per stage for --schedule interleaved (default: searched over 2..4)")
    t.add_argument("--efficiency", type=float, default=None,
                   help="one flat fraction of peak FLOP/s instead of the cluster's compute model")
    t.add_argument("--margin", type=float, default=0.10, help="share of GPU memory kept free (0.10)")
    c = p.add_argument_group("cluster")
    c.add_argument("--cluster", type=_cluster_name, default=None,
                   help=f"hardware preset ({', '.join(CLUSTER_PRESETS)}) or a cluster .json file "
                        f"(--save-cluster); default a100-80g")
    c.add_argument("--gpus", type=int, help="total GPUs (default: one node)")
    c.add_argument("--gpus-per-node", type=int)
    c.add_argument("--gpu-memory", type=float, help="GB per GPU")
    c.add_argument("--intra-bw", type=float, help="intra-node bus bandwidth per GPU, GB/s")
    c.add_argument("--inter-bw", type=float, help="inter-node bandwidth per GPU, GB/s")
    c.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per GPU for --dtype")
    c.add_argument("--host-ram", type=float, help="host RAM per node, GB (offload must fit in it)")
    c.add_argument("--calibrate", metavar="BENCH_JSON",
                   help="fit the compute model and link bandwidths to a `pyparallel bench --json` file")
    c.add_argument("--save-cluster", metavar="FILE", help="write the (calibrated) cluster as JSON for --cluster")
    s = p.add_argument_group("search")
    s.add_argument("--dp", type=int, help="fix the data-parallel degree")
    s.add_argument("--tp", type=int, help="fix the tensor-parallel degree")
    s.add_argument("--pp", type=int, help="fix the pipeline-parallel degree")
    s.add_argument("--zero", type=_stages, default=(0, 1, 2, 3), help="ZeRO stages to try (default 0,1,2,3)")
    s.add_argument("--offload", choices=("auto", "on", "off"), default="auto")
    s.add_argument("--allow-cross-node-tp", action="store_true")
    s.add_argument("--max-params", action="store_true",
                   help="report the largest model (this shape family) that fits, per layout family")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="FILE", help="write every evaluated candidate as JSON ('-': stdout)")
    o.add_argument("--explain", action="store_true", help="print the formulas with numbers")
    o.add_argument("--top", type=int, default=10, help="table rows (default 10)")
    o.add_argument("--plain", action="store_true", help="plain-text table even if rich is installed")


_SIZE_FIELDS = {"layers": "layers", "hidden": "hidden", "heads": "heads", "kv_heads": "kv_heads",
                "ffn": "ffn", "vocab": "vocab"}


def model_from_args(a: argparse.Namespace) -> ModelSpec:
    sizes = {f: getattr(a, k) for k, f in _SIZE_FIELDS.items() if getattr(a, k) is not None}
    if a.params is not None:
        if a.model or sizes:
            raise PlanError("--params stands alone: drop --model and the explicit sizes, or drop --params")
        return ModelSpec.from_params(a.params)
    if a.model:
        base = resolve_model(a.model)
        return replace(base, **sizes, name=base.name + (" (modified)" if sizes else "")).validate()
    missing = [f"--{k}" for k in ("layers", "hidden", "heads") if k not in sizes]
    if missing:
        raise PlanError("give a model: --model NAME|config.json, --params N, or --layers/--hidden/--heads "
                        f"(missing {', '.join(missing)})")
    llama = a.arch == "llama"
    spec = ModelSpec(name=f"custom {sizes['layers']}×{sizes['hidden']}", layers=sizes["layers"],
                     hidden=sizes["hidden"], heads=sizes["heads"],
                     vocab=sizes.get("vocab", 32000 if llama else 50257), kv_heads=sizes.get("kv_heads"),
                     ffn=sizes.get("ffn"), positions=0, tied=not llama, bias=not llama, gated_mlp=llama,
                     norm="rmsnorm" if llama else "layernorm", default_seq_len=a.seq_len or 2048,
                     fused_attention=llama)
    if not llama:  # GPT-2 style learns one position embedding per context position
        spec = replace(spec, positions=a.seq_len or 2048)
    return spec.validate()


def specs_from_args(a: argparse.Namespace):
    """(model, train, cluster, options) from parsed arguments; raises PlanError on bad input."""
    if a.seq_len is not None and a.seq_len <= 0:
        raise PlanError(f"--seq-len must be positive, got {a.seq_len}")
    model = model_from_args(a)
    if a.attention is not None:
        model = replace(model, fused_attention=a.attention == "fused")
    given = dict(gpus_per_node=a.gpus_per_node, memory_gb=a.gpu_memory, intra_bw=a.intra_bw,
                 inter_bw=a.inter_bw, peak_tflops=a.peak_tflops,
                 peak_tflops_fp32=a.peak_tflops if a.dtype == "fp32" else None, host_ram_gb=a.host_ram)
    given = {k: v for k, v in given.items() if v is not None}
    if a.calibrate:
        from pyparallel.planner.calibrate import calibrate_file

        cal = calibrate_file(a.calibrate, a.cluster)  # the bench's own preset unless --cluster names one
        print("\n".join(cal.lines()), file=sys.stderr if a.json == "-" else sys.stdout)
        cluster = replace(cal.cluster, **given).validate()
    else:
        cluster = resolve_cluster(a.cluster or "a100-80g", **given)
    gpus = a.gpus if a.gpus is not None else cluster.gpus_per_node
    if gpus < 1:
        raise PlanError(f"--gpus must be >= 1, got {gpus}")
    global_batch = a.global_batch if a.global_batch is not None else gpus * -(-256 // gpus)
    train = TrainSpec(seq_len=a.seq_len if a.seq_len is not None else model.default_seq_len,
                      global_batch=global_batch,
                      micro_batch=a.micro_batch, dtype=a.dtype, optimizer=a.optimizer, recompute=a.recompute,
                      sequence_parallel=a.sequence_parallel, schedule=a.schedule,
                      virtual_stages=a.virtual_stages, efficiency=a.efficiency, margin=a.margin).validate()
    if a.top < 1:
        raise PlanError(f"--top must be >= 1, got {a.top}")
    options = SearchOptions(gpus=gpus, allow_cross_node_tp=a.allow_cross_node_tp, zero_stages=a.zero,
                            offload=a.offload, tp=a.tp, pp=a.pp, dp=a.dp)
    if a.save_cluster:
        from pyparallel.planner.calibrate import save_cluster

        try:
            save_cluster(cluster, a.save_cluster)
        except OSError as exc:
            raise PlanError(f"cannot write {a.save_cluster}: {exc.strerror}") from None
    return model, train, cluster, options


def run_plan(a: argparse.Namespace) -> int:
    """The ``plan`` subcommand; returns the exit status (2 on bad input, with a one-line message)."""
    from pyparallel.planner.recommend import plan  # the search lives behind the argument checks
    from pyparallel.planner.report import render, write_json

    try:
        specs = specs_from_args(a)
        if a.max_params:
            from pyparallel.planner.maxparams import max_params_lines

            print("\n".join(max_params_lines(*specs)))
            return 0
        result = plan(*specs)
    except PlanError as exc:
        print(f"pyparallel plan: {exc}", file=sys.stderr)
        return 2
    if a.json == "-":
        write_json(result, "-")
        return 0
    render(result, top=a.top, plain=a.plain)
    if a.explain:
        from pyparallel.planner.explain import explain_lines

        print()
        print("\n".join(explain_lines(result.problem, result.best)))
    if a.json:
        try:
            write_json(result, a.json)
        except OSError as exc:
            print(f"pyparallel plan: cannot write {a.json}: {exc.strerror}", file=sys.stderr)
            return 2
    return 0
