"""``--explain``: every formula behind one candidate, with its numbers substituted.

The values printed are the ones the search computed (read back from the candidate), so the explanation
cannot drift from the ranking; only the symbolic text is assembled here.
"""

from __future__ import annotations

from pyparallel.planner import memory as mem
from pyparallel.planner import steptime
from pyparallel.planner.search import Candidate, Problem
from pyparallel.planner.specs import GB


def _gb(x: float) -> str:
    if x == 0:
        return "0"
    return f"{x / GB:.3g} GB" if x >= 1e8 else f"{x / 1e6:.3g} MB"


def _states(pb: Problem, c: Candidate, params_rank: float) -> list[str]:
    per = mem.state_bytes_per_param(pb.train.dtype, pb.train.optimizer)
    sharded = {0: set(), 1: {"optimizer", "master"}, 2: {"optimizer", "master", "grads"},
               3: {"optimizer", "master", "grads", "params"}}[c.zero_stage]
    full = " + ".join(f"{per[k]}Ψ" for k in per if per[k] and k not in sharded)
    split = sum(per[k] for k in per if k in sharded)
    formula = " + ".join(x for x in (full, f"{split}Ψ/N" if split else "") if x)
    name = "DDP" if not c.zero_stage else f"ZeRO-{c.zero_stage}"
    total = sum(per[k] * params_rank / (c.dp if k in sharded else 1) for k in per)
    out = [f"Model states (Rajbhandari et al. 2020), {name}, N = dp = {c.dp}: {formula} = {_gb(total)}"
           + (" before offload" if c.offload else "")]
    for part in ("params", "grads", "master", "optimizer"):
        if not per[part]:
            continue
        n = "/N" if part in sharded else ""
        value = per[part] * params_rank / (c.dp if part in sharded else 1)
        where = " → CPU (offload)" if c.offload and part in ("master", "optimizer") else ""
        out.append(f"  {part:<9} {per[part]}Ψ{n} = {per[part]} × {params_rank:.4g}{f' / {c.dp}' if n else ''}"
                   f" = {_gb(value)}{where}")
    return out


def _activation_formula(pb: Problem, c: Candidate) -> tuple[str, str]:
    tr, m = pb.train, pb.model
    s, b, h, a, t = tr.seq_len, c.micro_batch, m.hidden, m.heads, c.tp
    sub = f"s={s}, b={b}, h={h}, a={a}, t={t}"
    if c.recompute == "full":
        only = " (full recompute: layer input only)"
        return ("2·s·b·h" + ("/t" if c.sequence_parallel else "") + only, sub)
    no_scores = c.recompute == "selective" or m.fused_attention
    attn = "" if no_scores else " + 5·a·s/h"
    why = " (fused attention: no s×s scores)" if m.fused_attention and c.recompute == "none" else ""
    if c.sequence_parallel or t == 1:
        return (f"s·b·h{'/t' if t > 1 else ''}·(34{attn}){why}", sub)
    return (f"s·b·h·(10 + 24/t{attn.replace('/h', '/(h·t)')}){why}", sub)


def _activations(pb: Problem, c: Candidate, worst: dict) -> list[str]:
    act = worst["act"]
    if not pb.model.has_shape:
        return ["Activations: not modelled (only a parameter count was given)"]
    formula, sub = _activation_formula(pb, c)
    return [
        f"Activations per layer (Korthikanti et al. 2022): {formula}, {sub} = {_gb(act['per_layer'])}",
        f"  × {worst['layers']} layers on stage {worst['stage']} × {act['in_flight']:g} micro-batch(es) in "
        f"flight ({pb.train.schedule}) = {_gb(act['layers'])}; + embedding mask {_gb(act['embedding'])}"
        f" + output layer 4·s·b·(h+V)/t (last stage) {_gb(act['output'])} = {_gb(act['total'])}",
    ]


def _comm(pb: Problem, c: Candidate) -> list[str]:
    d = c.detail
    out = ["Communication per rank per step (ring: all-reduce 2(N−1)/N, all-gather/reduce-scatter (N−1)/N):"]
    if not d["phases"]:
        out.append("  none (a single GPU per replica and no data parallelism)")
    for ph in d["phases"]:
        bw = d["bandwidth"][ph.axis]
        secs = ph.bytes / (bw * 1e9)
        hide = f"overlaps {ph.overlap}" if ph.overlap != "none" else "on the critical path"
        out.append(f"  {ph.axis}: {ph.name}: {_gb(ph.bytes)} × {ph.repeats} at {bw:g} GB/s = "
                   f"{secs * ph.repeats * 1e3:.1f} ms, {hide}")
    ex = c.exposed_s
    out.append(f"  exposed (steptime.py: overlapped compute c beside a collective x costs max(c + κx, x)): "
               f"dp {ex['dp'] * 1e3:.1f} ms, tp {ex['tp'] * 1e3:.1f} ms, pp {ex['pp'] * 1e3:.1f} ms"
               + (f", offload {ex['offload']:.2f} s (PCIe {d['offload']['pcie']:.2f} s + CPU optimizer "
                  f"{d['offload']['cpu_step']:.2f} s)" if c.offload else ""))
    return out


def _layout_of(c: Candidate) -> steptime.Layout:
    return steptime.Layout(c.dp, c.tp, c.pp, c.zero_stage, c.offload, c.micro_batch, c.num_microbatches,
                           c.recompute, c.sequence_parallel, c.schedule, c.virtual_stages)


def _time(pb: Problem, c: Candidate) -> list[str]:
    d, m, tr = c.detail, pb.model, pb.train
    p, mb_n = c.pp, c.num_microbatches
    flops = (f"(6Ψ + 12·L·h·s)·tokens = (6 × {m.num_params():.4g} + 12 × {m.layers} × {m.hidden} × "
             f"{tr.seq_len}) × {tr.tokens:,}" if m.has_shape else f"6Ψ·tokens = 6 × {m.num_params():.4g} × "
             f"{tr.tokens:,}")
    rec = {"full": " + the layers' forward again (full recompute)",
           "selective": " + attention-core recompute"}.get(c.recompute, "")
    cm = d["compute_model"]
    curve = (f"GEMMs at {cm.eff:g} × k/(k + {cm.half:g}) of peak (k: reduction dimension), roofline with "
             f"{cm.hbm / 1e9:g} GB/s HBM, elementwise 5 passes over the stored activations"
             if cm.half > 0 or cm.hbm > 0 else f"flat {cm.eff:g} of peak")
    bubble_f = {"interleaved": f"Σ T·⌈n/v⌉/n over the other p−1 stages, v = {c.virtual_stages}",
                "zb-h1": "Σ (T_F + T_B − T_W) over the other p−1 stages",
                "zbv": "Σ (T_F + T_B − 2T_W)/2 over the other p−1 stages"}.get(
        c.schedule, "Σ T over the other p−1 stages (fill and drain; equal stages: (p−1)/(m+p−1) of the "
                    "pipeline time)")
    dp_how = "hidden in the last backward but the last bucket" if steptime.reduces_in_backward(
        _layout_of(c)) else "after the last micro-batch, exposed"
    return [
        f"FLOPs (Narayanan et al. 2021): {flops} = {d['model_flops']:.4g}{rec} → {d['hw_flops']:.4g} executed",
        f"Compute (compute.py): {curve}; on the slowest stage {c.compute_s:.4g} s per step",
        f"Pipeline: m = {mb_n} micro-batches on the slowest stage {d['busy_s']:.4g} s (compute + exposed TP, "
        f"p2p, ZeRO-3) + bubble {bubble_f} = {d['bubble_s']:.4g} s"
        + (f" ({p} stages, {c.bubble_fraction:.1%} of the pipeline time)" if p > 1 else ""),
        f"Step time: {d['busy_s']:.4g} + {d['bubble_s']:.4g} + dp {c.exposed_s['dp'] * 1e3:.1f} ms ({dp_how}; "
        f"ZeRO-3's per unit included above) + optimizer {c.exposed_s['optimizer'] * 1e3:.1f} ms + offload "
        f"{c.exposed_s['offload']:.3g} s = {c.step_time_s:.4g} s",
        f"MFU: model FLOPs / (step × GPUs × peak) = {d['model_flops']:.4g} / ({c.step_time_s:.4g} × "
        f"{d['world']} × {d['peak']:.4g}) = {c.mfu:.1%}",
    ]


def explain_lines(pb: Problem, c: Candidate) -> list[str]:
    """The formulas with numbers for candidate ``c``, one line each."""
    worst = c.detail["worst"]
    mb = c.memory_bytes
    lines = [f"Explain: {c.label()} (fullest pipeline stage: {worst['stage']})",
             f"Parameters per rank Ψ = stage {worst['stage']} parameters / tp = "
             f"{worst['params_rank'] * c.tp:,.0f} / {c.tp} = {worst['params_rank']:.4g}"]
    lines += _states(pb, c, worst["params_rank"])
    lines += _activations(pb, c, worst)
    lines.append(f"Buffers (gradient buckets, ZeRO-3 gathered layers, p2p): {_gb(mb['buffers'])}")
    verdict = "fits" if c.fits else "does NOT fit"
    lines.append(f"Per-GPU total: params {_gb(mb['params'])} + grads {_gb(mb['grads'])} + optimizer "
                 f"{_gb(mb['optimizer'])} + activations {_gb(mb['activations'])} + buffers "
                 f"{_gb(mb['buffers'])} = {_gb(mb['total'])} vs {_gb(pb.usable_bytes)} usable → {verdict}")
    lines += _comm(pb, c)
    lines += _time(pb, c)
    return lines
