"""``pyparallel train``: train the built-in GPT, a Hugging Face config (random init) or fine-tune a Hugging Face
folder's weights on a text file with any DP x TP x PP layout, ZeRO stage, precision and offload, with
periodic checkpoints and resume.

    pyparallel train --dp 2 --tp 2 --steps 200                 # spawns dp*tp*pp local processes
    torchrun --nproc-per-node 4 -m pyparallel.cli train --tp 2  # or under torchrun (any number of nodes)
    pyparallel train --pp 2 --micro-batches 4 --zero 1 --dtype bf16 --checkpoint-dir ckpt --save-every 50
    pyparallel train ... --checkpoint-dir ckpt --resume        # continue from ckpt/latest
    pyparallel train ... --checkpoint-dir /local/ckpt --checkpoint-storage node-local   # each node's own disk
    pyparallel train --model hf-folder --tp 2 --checkpoint-dir ckpt --export tuned   # fine-tune, export

Text is the corpus shipped with the package, or ``--text``, encoded byte-level (vocabulary 256), or by the
tokenizer of a ``--model`` folder that holds one (``tokenizer.json`` / ``tokenizer_config.json``; read with
``transformers.AutoTokenizer``, local files only).

A ``--model`` folder with ``model.safetensors`` (or ``model.safetensors.index.json`` and its shards) is
built on the meta device from its config.json and handed to ``pyparallel.parallelize(weights=folder)``:
each rank reads only the slices it keeps, and no rank builds the whole model. A built-in GPT, or a folder
(or config.json) without weights, is a random initialisation, also built on meta: each rank initialises
one full-size module at a time under a seed of its name and ``--seed`` and keeps its slices
(``pyparallel.materialize``), so every layout starts from the same values. Hugging Face models are built
in fp32 (the masters; ``--dtype`` chooses the compute precision) whatever dtype the config names.
Step k's global batch is a deterministic function of k (``pyparallel.data.batch``), so a resumed run,
or one restarted by ``torchrun --max-restarts``, sees exactly the batches the uninterrupted run would
have: on CPU its losses are equal bit for bit. Each DP replica trains on its rows of the global batch.
Rank 0 shows a progress bar (loss, tokens/s), appends one JSON line per step to ``--metrics`` and prints
``RESULT {...}`` at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pyparallel train", description="Train a GPT, or fine-tune a Hugging Face "
                                "model, with a parallel layout on a text file, with checkpoints and resume.")
    p.add_argument("--model", default="tiny", help="built-in GPT preset (tiny, small-test, bench, gpt2-small, ...), "
                   "a Hugging Face config.json (random init), or a Hugging Face folder: with model.safetensors "
                   "(or an index and its shards) it fine-tunes those weights, each rank reading only its slices; "
                   "with config.json alone, random init")
    p.add_argument("--text", default=None, help="UTF-8 text file to train on (default: the shipped corpus); "
                   "encoded by the --model folder's tokenizer when it has one (tokenizer.json or "
                   "tokenizer_config.json, local files only), else byte-level (vocabulary 256). Rank 0 says which")
    p.add_argument("--dp", type=int, default=None, help="data-parallel degree (default: what is left)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage over the DP axis")
    p.add_argument("--offload", action="store_true", help="optimizer state and master weights on the host")
    p.add_argument("--micro-batches", type=int, default=None, help="micro-batches per step (default: pp)")
    p.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved", "zb-h1", "zbv"),
                   help="pipeline schedule (with --pp > 1); zb-h1 and zbv defer the weight gradients into the "
                   "bubbles (zero-bubble, Qi et al. 2023)")
    p.add_argument("--dtype", default="fp32", choices=sorted(_DTYPES), help="compute precision (fp32 master)")
    p.add_argument("--steps", type=int, default=100, help="train until this many steps are done")
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    p.add_argument("--seq", type=int, default=64, help="sequence length (tokens)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=0, help="linear learning-rate warm-up steps")
    p.add_argument("--clip", type=float, default=1.0, help="clip the global gradient norm (0: off)")
    p.add_argument("--seed", type=int, default=0, help="model initialisation and data order")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-storage", default="shared", choices=("shared", "node-local"),
                   help="shared (default): --checkpoint-dir is one folder every node sees; node-local: a folder "
                   "on each node's own disk, each node keeping its own ranks' pieces (a resume needs the same "
                   "layout, with every rank on the node that saved it)")
    p.add_argument("--save-every", type=int, default=0, help="save every N steps (0: only at the end)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint, if any (a "
                   "Hugging Face folder's weights are then not read: the checkpoint holds every value)")
    p.add_argument("--export", default=None, metavar="DIR", help="after training, write the final checkpoint as a "
                   "Hugging Face folder (from_pretrained loads it; the --model folder's tokenizer is copied): needs "
                   "a Hugging Face --model and --checkpoint-dir")
    p.add_argument("--metrics", default=None, help="append one JSON line per step here (rank 0)")
    p.add_argument("--nprocs", type=int, default=None, help="local processes when not under torchrun "
                   "(default: dp*tp*pp)")
    p.add_argument("--gc-every", type=int, default=1, metavar="N", help="Python's garbage collector runs "
                   "every N steps, at the same point on every rank, and never inside a step (0: Python's "
                   "own schedule, which pauses ranks at different moments)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def check_args(args) -> None:
    """Configuration errors, before any process starts (ValueError naming the values)."""
    for name in ("tp", "pp", "steps", "batch", "seq"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.dp is not None and args.dp < 1:
        raise ValueError(f"--dp must be >= 1, got {args.dp}")
    if args.save_every < 0:
        raise ValueError(f"--save-every must be >= 0, got {args.save_every}")
    if args.gc_every < 0:
        raise ValueError(f"--gc-every must be >= 0, got {args.gc_every}")
    if (args.save_every or args.resume) and not args.checkpoint_dir:
        raise ValueError("--save-every and --resume need --checkpoint-dir")
    if args.checkpoint_storage != "shared" and not args.checkpoint_dir:
        raise ValueError(f"--checkpoint-storage {args.checkpoint_storage} needs --checkpoint-dir")
    if args.export is not None:
        if not args.checkpoint_dir:
            raise ValueError("--export needs --checkpoint-dir (it exports the final checkpoint)")
        if not is_hf(args.model):
            raise ValueError(f"--export writes a Hugging Face folder: it needs a Hugging Face --model (a config.json "
                             f"or a folder), not the built-in preset {args.model!r}")
        if os.path.exists(args.export) and not os.path.isdir(args.export):
            raise ValueError(f"--export {args.export!r} is a file, not a folder")
    for name in ("lr", "weight_decay", "clip", "warmup"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.micro_batches is not None and args.micro_batches < 1:
        raise ValueError(f"--micro-batches must be >= 1, got {args.micro_batches}")
    if args.nprocs is not None:
        if args.nprocs < 1:
            raise ValueError(f"--nprocs must be >= 1, got {args.nprocs}")
        cell = args.tp * args.pp
        if args.dp is not None and args.dp * cell != args.nprocs:
            raise ValueError(f"--dp {args.dp} x --tp {args.tp} x --pp {args.pp} = {args.dp * cell} processes, "
                             f"but --nprocs is {args.nprocs}")
        if args.nprocs % cell:
            raise ValueError(f"--nprocs {args.nprocs} is not divisible by --tp {args.tp} x --pp {args.pp} = {cell}")
    if args.checkpoint_dir and os.path.exists(args.checkpoint_dir) and not os.path.isdir(args.checkpoint_dir):
        raise ValueError(f"--checkpoint-dir {args.checkpoint_dir!r} is a file, not a folder")
    dp = args.dp or ((args.nprocs // (args.tp * args.pp)) if args.nprocs else 1)
    m = args.micro_batches or args.pp
    if args.batch % (dp * m):
        raise ValueError(f"--batch {args.batch} must divide into dp ({dp}) x micro-batches ({m}) = {dp * m} "
                         f"equal parts")


def preflight(args) -> None:
    """What would otherwise fail inside every rank, checked once before any process starts: the text, the
    model (built on the meta device: no memory), its split over tp and pp, and the checkpoint to resume."""
    import torch

    tokens, vocab, encoding = encode_text(args)
    if tokens.numel() <= args.seq + 1:
        unit = "byte tokens" if encoding.startswith("byte") else f"tokens ({encoding})"
        raise ValueError(f"--text {args.text!r} has {tokens.numel()} {unit}; --seq {args.seq} needs more "
                         f"than {args.seq + 1}")
    with torch.device("meta"):
        model = build_model(args, vocab)
    weights = hf_weights(args.model)
    if weights is not None:
        from pyparallel.checkpoint import weights as weights_mod

        weights_mod.open_weights(weights, model)  # names and shapes, read from the headers only
    if args.tp > 1:
        from pyparallel.tensor_parallel import plans

        plan = plans.detect(model)
        if plan is None:
            raise ValueError(f"--tp {args.tp}: no built-in tensor-parallel plan for {type(model).__name__}")
        plans.check_sizes(plan, args.tp)
    if args.pp > 1:
        from pyparallel.pipeline_parallel import partition, schedules

        v = 2 if args.schedule == "interleaved" else 1
        schedules.check_schedule(args.schedule, args.pp, v)
        schedules.check_config(args.schedule, args.pp, args.micro_batches or args.pp, v)
        # ZBV holds two chunks per rank whatever v says: a model needs 2 * pp blocks for it.
        partition.plan_chunks(partition.to_blocks(model)[0], args.pp, schedules.chunks_per_stage(args.schedule, v),
                              None)
    # Node-local checkpoints are found (and their model checked) by all ranks together, in train().
    if args.resume and args.checkpoint_dir and args.checkpoint_storage == "shared":
        folder, _ = resume_folder(args.checkpoint_dir)
        if folder is not None:
            from pyparallel import checkpoint

            saved = checkpoint.read_manifest(folder, verify=False).get("extra", {}).get("model")
            if saved is not None and saved != args.model:
                raise ValueError(f"--resume: {folder!r} was saved by a run with --model {saved!r}, this one has "
                                 f"--model {args.model!r}")


def resume_folder(root: str) -> tuple[str | None, str | None]:
    """The checkpoint ``--resume`` continues from, and a note when it is not what ``latest`` names: a
    broken ``latest`` falls back to the newest complete step (None, None: nothing saved yet)."""
    from pyparallel import checkpoint

    if not os.path.isdir(root) or not (os.path.exists(os.path.join(root, "latest"))
                                       or checkpoint.complete_steps(root)):
        return None, None
    try:
        return checkpoint.resolve(root), None
    except checkpoint.CheckpointError as exc:
        folder = checkpoint.newest_complete(root)
        if folder is None:
            raise ValueError(f"--resume: {exc}; and no complete step is left under {root!r}") from exc
        return folder, f"{exc}; resuming from {os.path.basename(folder)}, the newest complete step"


# ------------------------------------------------------------------------------------------- model


def is_hf(model: str) -> bool:
    """``--model`` names a Hugging Face config.json or folder (else a built-in GPT preset)."""
    return model.endswith(".json") or os.path.isdir(model)


_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def hf_weights(model: str) -> str | None:
    """The ``--model`` folder when it holds safetensors weights (fine-tuning), else None (random init). A
    folder with only PyTorch pickles is refused: they cannot be read a slice at a time."""
    if not os.path.isdir(model):
        return None
    if any(os.path.exists(os.path.join(model, f)) for f in _WEIGHT_FILES):
        return model
    pickles = [f for f in ("pytorch_model.bin", "pytorch_model.bin.index.json")
               if os.path.exists(os.path.join(model, f))]
    if pickles:
        raise ValueError(f"--model {model!r} holds {pickles[0]} but no model.safetensors: weights are streamed "
                         f"slice by slice from safetensors only; convert the folder once with "
                         f"save_pretrained(..., safe_serialization=True)")
    return None


def tokenizer_of(args):
    """The ``--model`` folder's tokenizer (local files only), or None: byte-level tokens."""
    if not (os.path.isdir(args.model) and any(os.path.exists(os.path.join(args.model, f)) for f in _TOKENIZER_FILES)):
        return None
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--model {args.model!r}: its tokenizer cannot be loaded: "
                         f"{type(exc).__name__}: {exc}") from exc


def encode_text(args):
    """(tokens, vocabulary the model must cover, a line saying how the text was encoded)."""
    from pyparallel import data

    try:
        text = data.load_text(args.text)
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--text {args.text!r} cannot be read as UTF-8 text: {exc}") from exc
    tok = tokenizer_of(args)
    if tok is None:
        return data.encode(text), data.VOCAB_SIZE, "byte-level tokens (vocabulary 256)"
    import torch

    ids = torch.tensor(tok(text, add_special_tokens=False, verbose=False)["input_ids"], dtype=torch.long)
    vocab = int(ids.max()) + 1 if ids.numel() else 0
    return ids, vocab, f"{type(tok).__name__} of {args.model} ({ids.numel()} tokens)"


def build_model(args, vocab: int):
    """The model; ``train`` builds it under ``torch.device("meta")`` (``parallelize`` then gives each rank
    its pieces). ``vocab``: the largest token id + 1 that the text holds."""

    if is_hf(args.model):
        import transformers

        path = args.model if args.model.endswith(".json") else os.path.join(args.model, "config.json")
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
            config = transformers.AutoConfig.for_model(**raw)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"--model {path!r} is not a Hugging Face config.json this transformers reads: "
                             f"{type(exc).__name__}: {exc}") from exc
        if getattr(config, "vocab_size", vocab) < vocab:
            raise ValueError(f"{path}: vocab_size {config.vocab_size} is smaller than the text's tokens need "
                             f"({vocab})")
        # fp32 masters whatever dtype the config names (--dtype is the compute precision).
        return transformers.AutoModelForCausalLM.from_config(config).float()
    from pyparallel.models.gpt import GPT, gpt_config

    cfg = gpt_config(args.model, vocab_size=vocab)
    if cfg.block_size < args.seq:
        cfg = gpt_config(args.model, vocab_size=vocab, block_size=args.seq)
    return GPT(cfg, seed=args.seed)


def _lr_at(args, step: int) -> float:
    if args.warmup and step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.lr


# ------------------------------------------------------------------------------------------ faults


def _maybe_fail(rank: int, step: int, where: str) -> None:
    """Fault injection for restart tests: ``PYPARALLEL_FAULT=rank=R,step=S,where=step|save,marker=PATH``
    ends rank R abruptly at step S (or inside the save of step S), once: the marker file records it."""
    spec = os.environ.get("PYPARALLEL_FAULT")
    if not spec:
        return
    f = dict(kv.split("=", 1) for kv in spec.split(","))
    if int(f["rank"]) != rank or int(f["step"]) != step or f.get("where", "step") != where:
        return
    marker = f.get("marker")
    if marker:
        if os.path.exists(marker):
            return
        with open(marker, "w") as fh:
            fh.write(f"rank {rank} failed at {where} {step}\n")
    print(f"pyparallel train: injected fault on rank {rank} at {where} {step}", file=sys.stderr, flush=True)
    os._exit(17)


def _save(args, pm, step: int, rank: int) -> None:
    from pyparallel import checkpoint

    if os.environ.get("PYPARALLEL_FAULT"):
        checkpoint.store._before_commit = lambda: _maybe_fail(rank, step, "save")  # test seam
    checkpoint.save(args.checkpoint_dir, pm, pm.optimizer, step=step, extra={"model": args.model},
                    storage=args.checkpoint_storage)


# -------------------------------------------------------------------------------------------- train


def train(args) -> dict:
    """One rank's training loop (called in every process)."""
    import torch

    import pyparallel
    from pyparallel import checkpoint, collector, data, materialize

    mesh = pyparallel.init(dp=args.dp, tp=args.tp, pp=args.pp)
    tokens, vocab, encoding = encode_text(args)
    node_local = args.checkpoint_storage == "node-local"
    if args.resume and node_local:
        folder, note = _node_local_resume(args, mesh), None
    else:
        folder, note = resume_folder(args.checkpoint_dir) if args.resume else (None, None)
    # No rank builds the whole model: it is split on meta and each rank reads its slices of the folder, or
    # initialises one full-size module at a time and keeps its slices (a preset GPT: its GPT-2 init; a
    # config.json: as from_config does), so the values do not depend on the layout. A resumed run skips the
    # folder: the default init's values are overwritten by the checkpoint's.
    weights = hf_weights(args.model)
    with torch.device("meta"):
        model = build_model(args, vocab)
    weights = None if folder is not None else weights
    init = materialize.seeded_default(model, args.seed) if weights is None and is_hf(args.model) else None
    if mesh.rank == 0 and not args.no_progress:
        print(f"pyparallel train: text as {encoding}"
              + (f"; weights streamed from {weights}" if weights else ""), file=sys.stderr, flush=True)
    dtype = getattr(torch, _DTYPES[args.dtype])
    pm = pyparallel.parallelize(model, mesh, zero_stage=args.zero, param_dtype=None if args.dtype == "fp32" else dtype,
                                num_microbatches=args.micro_batches or args.pp, schedule=args.schedule,
                                virtual_stages=2 if args.schedule == "interleaved" else 1,
                                optimizer=torch.optim.AdamW, lr=args.lr, weight_decay=args.weight_decay,
                                clip_grad_norm=args.clip or None, offload_optimizer=args.offload,
                                weights=weights, init=init)
    start = 0
    if args.resume and not node_local:
        _same_checkpoint_everywhere(mesh, args.checkpoint_dir, folder)
    if folder is not None:
        if note and mesh.rank == 0:
            print(f"pyparallel train: {note}", file=sys.stderr, flush=True)
        start = checkpoint.load(folder, pm, pm.optimizer, storage=args.checkpoint_storage)["step"]
    rows = pm.batch_slice(args.batch)
    first = mesh.rank == 0
    bar = _progress(first and not args.no_progress, start, args.steps)
    losses, rates = [], []
    # Python's collector between steps only (collector.py), or on its own schedule with --gc-every 0.
    gcs = collector.StepCollector(args.gc_every) if args.gc_every else None
    with gcs or contextlib.nullcontext():
        for step in range(start, args.steps):
            _maybe_fail(mesh.rank, step, "step")
            t0 = time.perf_counter()
            for group in pm.optimizer.param_groups:
                group["lr"] = _lr_at(args, step)
            idx, tgt = data.batch(tokens, step, args.batch, args.seq, seed=args.seed)
            loss = pm.step(idx[rows].to(mesh.device), tgt[rows].to(mesh.device))
            rate = args.batch * args.seq / (time.perf_counter() - t0)
            losses.append(loss)
            rates.append(rate)
            if first:
                _log(args, bar, step, loss, rate, pm)
            done = step + 1
            if args.checkpoint_dir and ((args.save_every and done % args.save_every == 0) or done == args.steps):
                _save(args, pm, done, mesh.rank)
            if gcs is not None:
                gcs.step()
    if bar is not None:
        bar.close()
    if args.export is not None:
        _export(args, mesh)
    return {"losses": losses, "start": start, "steps": args.steps, "world_size": mesh.world_size,
            "layout": {"dp": mesh.dp, "tp": mesh.tp, "pp": mesh.pp, "zero": args.zero},
            "tokens_per_s": sorted(rates)[len(rates) // 2] if rates else None}


def _export(args, mesh) -> None:
    """Rank 0 writes the final checkpoint as a Hugging Face folder (streamed one tensor at a time: no rank
    gathers the model), with the --model folder's tokenizer; the others wait, so that the job ends when
    the folder is complete."""
    from pyparallel import checkpoint, comm

    if mesh.rank == 0:
        checkpoint.export_pretrained(args.checkpoint_dir, args.export)
        tok = tokenizer_of(args)
        if tok is not None:
            tok.save_pretrained(args.export)
        print(f"pyparallel train: exported {args.export}", file=sys.stderr, flush=True)
    comm.barrier(mesh.world_group)


def _node_local_resume(args, mesh) -> str | None:
    """This rank's folder of the newest save complete on every node (all ranks together), checked to come
    from the same --model; None when no node has a checkpoint yet."""
    from pyparallel import checkpoint

    try:
        folder = checkpoint.newest_common(args.checkpoint_dir, mesh)
    except checkpoint.CheckpointError as exc:
        raise checkpoint.CheckpointError(f"--resume: {exc}") from None
    if folder is not None:
        saved = checkpoint.read_manifest(folder, verify=False).get("extra", {}).get("model")
        if saved is not None and saved != args.model:
            raise ValueError(f"--resume: {folder!r} was saved by a run with --model {saved!r}, this one has "
                             f"--model {args.model!r}")
    return folder


def _same_checkpoint_everywhere(mesh, root: str, folder: str | None) -> None:
    """Every rank must resume from the same checkpoint: a rank that sees another (or none) is on a node
    whose --checkpoint-dir is not the shared folder the others see, and would silently train other steps."""
    import socket

    from pyparallel import comm

    seen = comm.all_gather_object((os.path.basename(folder) if folder else None, socket.gethostname()),
                                  mesh.world_group)
    if len({name for name, _ in seen}) > 1:
        found = "; ".join(f"rank {r} on {host}: {name or 'nothing'}" for r, (name, host) in enumerate(seen))
        raise ValueError(f"--resume: the ranks do not see the same checkpoint under {root!r} ({found}); "
                         f"--checkpoint-dir must be one folder shared by every node")


def _progress(enabled: bool, start: int, total: int):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)


def _log(args, bar, step: int, loss: float, rate: float, pm) -> None:
    if bar is not None:
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{rate:,.0f}")
        bar.update(1)
    if args.metrics:
        with open(args.metrics, "a") as f:
            f.write(json.dumps({"step": step, "loss": loss, "tokens_per_s": rate,
                                "grad_norm": pm.last_grad_norm}) + "\n")


def _worker(args) -> dict:
    return train(args)


# What a rank raises for a user's mistake (printed as one line, exit 2); anything else is a bug or a fault
# and keeps its traceback (exit 1).
_USER_ERRORS = ("ValueError", "CheckpointError")


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse printed the usage line and the error
        return exc.code if isinstance(exc.code, int) else 2
    try:
        check_args(args)
        preflight(args)
    except Exception as exc:
        if type(exc).__name__ not in _USER_ERRORS:
            raise
        print(f"pyparallel train: {exc}", file=sys.stderr)
        return 2
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun (or launch): we are one rank
        try:
            result = train(args)
        except Exception as exc:
            if type(exc).__name__ not in _USER_ERRORS:
                raise
            print(f"pyparallel train: rank {os.environ['RANK']}: {exc}", file=sys.stderr, flush=True)
            return 2
        if int(os.environ["RANK"]) == 0:
            print("RESULT " + json.dumps(result), flush=True)
        import pyparallel

        pyparallel.shutdown()  # only after success: after an error a peer may be gone, and nothing is left to flush
        return 0
    import pyparallel

    nprocs = args.nprocs or (args.dp or 1) * args.tp * args.pp
    try:
        result = pyparallel.launch(_worker, nprocs, (args,))[0]
    except pyparallel.LaunchError as exc:
        if exc.exc_type in _USER_ERRORS:
            print(f"pyparallel train: rank {exc.rank}: {exc.exc_message.strip().splitlines()[0]}", file=sys.stderr)
            return 2
        print(f"pyparallel train: {exc}", file=sys.stderr)
        return 1
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
