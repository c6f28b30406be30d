"""Meta-device models with ``weights=`` / ``init=`` in every wrapper besides ``zero.setup`` (tests/test_weights.py):
``tensor_parallel.parallelize`` (tp=2), ``PipelineParallel`` (pp=2), ``pyparallel.parallelize`` (dp x tp x pp with
ZeRO) and ``DataParallel`` (dp=2).

Each parity test builds the model on the meta device and hands the wrapper a file written from a small random-init
model (``save_pretrained`` shards and an index for the Hugging Face models, one ``save_file`` for the built-in GPT;
nothing downloaded). Right after the wrapper is built, the gathered parameters must equal the file's tensors bit
for bit (each rank read only its pieces; TP vocabulary padding rows zero); then losses of 3 AdamW steps and the
parameters after them must equal one process that loaded the same file. Models and losses are float64 so that the
comparison can use assert_close's float64 tolerances: in float64 a different summation order (split batch,
split matmuls) leaves nothing that Adam amplifies past them. ``init=`` must equal the same initialisation in one
process exactly. Bad files are a ValueError naming the tensor, before any collective.

Tolerances: float64's for the built-in GPT and GPT-2, which compute in float64 throughout. The RMSNorm families
(LLaMA, Qwen2, Phi-3, Gemma 1 and 3) normalise in float32 whatever the model's dtype (transformers casts the
hidden states to float32 inside RMSNorm), so another summation order leaves float32 rounding in them: those
compare at float32's tolerances (assert_close's defaults for float32).

GPT-2 has a vocabulary of 67 (odd, like its 50257): tp=2 pads it to 128 rows. LLaMA and GPT-2 tie the embedding
to the LM head (across the two stages under pp=2); Qwen2 has attention biases and an untied head.
"""

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from dist import run
from models import TINY, batches, hf_model
from safetensors.torch import save_file

import pyparallel
from pyparallel import comm, materialize
from pyparallel.data_parallel.ddp import DataParallel
from pyparallel.models.gpt import GPT, gpt_config
from pyparallel.pipeline_parallel import PipelineParallel
from pyparallel.tensor_parallel import full_parameters
from pyparallel.tensor_parallel import parallelize as tp_parallelize

pytest.importorskip("transformers")

STEPS, BATCH, LR = 3, 4, 1e-2
VOCAB = {"gpt": 64, "llama": 64, "gpt2": 67, "qwen2": 64, "phi3": 64, "gemma": 64, "gemma3_text": 64}
KINDS = ("gpt", "llama", "gpt2", "qwen2")


def make(kind, meta=False, dtype=torch.float64):
    with torch.device("meta") if meta else torch.device("cpu"):
        if kind == "gpt":
            return GPT(gpt_config("tiny", **TINY)).to(dtype)
        return hf_model(kind, vocab=VOCAB[kind], tie_word_embeddings=kind != "qwen2").to(dtype)


def write(kind, path):
    """A checkpoint of ``kind`` whose values are not what a meta build (or its default init) would give."""
    torch.manual_seed(1)
    model = make(kind, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    if kind == "gpt":
        os.makedirs(path, exist_ok=True)
        save_file({n: p.detach().contiguous() for n, p in model.named_parameters()},
                  os.path.join(path, "model.safetensors"))
    else:
        model.save_pretrained(path, max_shard_size="20KB")
        assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))  # several shards
    return path


def data(kind, labels=False):
    """(ids, aligned targets) per step; ``labels``: the targets Hugging Face's ``labels=ids`` stand for (the
    ids shifted, the last position ignored)."""
    out = batches(STEPS, BATCH, vocab=VOCAB[kind])
    if labels and kind != "gpt":
        out = [(idx, torch.cat([idx[:, 1:], torch.full_like(idx[:, :1], -100)], 1)) for idx, _ in out]
    return out


def logits_of(model, idx):
    gpt = isinstance(getattr(model, "module", model), GPT)
    out = model(idx) if gpt else model(input_ids=idx)
    return out if torch.is_tensor(out) else out.logits


def ce64(logits, targets):
    """Token cross-entropy kept in float64 (the library's default loss computes in fp32)."""
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def reference(kind, path=None, labels=False):
    """One process: a real model that loaded the whole file (or, with no path, the meta model initialised by
    ``materialize.initialize``), trained STEPS AdamW steps on the whole batch. Returns (initial parameters,
    losses, final parameters)."""
    if path is None:
        model = make(kind, meta=True)
        materialize.initialize(model, torch.device("cpu"))
    else:
        model = make(kind)
        from pyparallel.checkpoint.weights import open_weights

        reader = open_weights(path, model)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(reader.full("model/" + n))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for idx, tgt in data(kind, labels):
        loss = ce64(logits_of(model, idx), tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return start, losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def check_equal(got: dict, want: dict, what: str) -> None:
    """Bit-for-bit: the tensors a wrapper loaded (or initialised) against the file (or one process)."""
    assert got.keys() == want.keys(), f"{what}: {sorted(set(got) ^ set(want))}"
    for n, t in want.items():
        assert torch.equal(got[n], t), f"{what}: {n} differs (max {(got[n] - t).abs().max():.3g})"


FP32_NORMS = ("llama", "qwen2", "phi3", "gemma", "gemma3_text")  # see the module docstring


def check_close(losses, params: dict, ref, kind: str, what: str) -> None:
    tol = dict(rtol=1.3e-6, atol=1e-5) if kind in FP32_NORMS else {}  # float32's defaults, else float64's
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), torch.tensor(ref[1], dtype=torch.float64),
                               msg=lambda m: f"{what} losses: {m}", **tol)
    assert params.keys() == ref[2].keys()
    for n, t in ref[2].items():
        torch.testing.assert_close(params[n], t, msg=lambda m, n=n: f"{what} {n}: {m}", **tol)


def no_collectives():
    return comm.comm_stats()["total"]["calls"] == 0


# ---------------------------------------------------------------------------------------- tensor parallel


def tp_train(kind, model):
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for idx, tgt in data(kind):
        # Vocabulary-parallel loss on split logits (float64 kept); HF: its unshifted labels, the reference's
        # shift of the same ids.
        loss = model(idx, tgt) if kind == "gpt" else model(input_ids=idx, labels=idx).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def tp_body(kind, path, ref):
    mesh = pyparallel.init(tp=2)
    model = tp_parallelize(make(kind, meta=True), mesh, weights=path)
    assert no_collectives()  # the split and the load are local
    assert not materialize.has_meta(model)
    check_equal(full_parameters(model), ref[0], f"{kind} tp=2 loaded")
    padded = [m for m in model.modules() if getattr(m, "padded_size", 0) > getattr(m, "num_embeddings", 0)]
    assert len(padded) == (kind == "gpt2")  # 67 rows padded to 128
    for m in padded:  # the padding rows (the tail of rank 1's shard) are in no piece of the file: zero
        rows = m.weight[m.valid_rows:]
        assert rows.shape[0] == (61 if mesh.tp_rank == 1 else 0) and torch.equal(rows, torch.zeros_like(rows))
    losses = tp_train(kind, model)
    check_close(losses, full_parameters(model), ref, kind, f"{kind} tp=2")
    return True


# + fused GQA qkv / gate_up; a scaled embedding; Gemma 3's rotary tables per layer type rebuilt on the meta model
@pytest.mark.parametrize("kind", [*KINDS, "phi3", "gemma", "gemma3_text"])
def test_tensor_parallel_meta_model_with_weights_equals_one_process(kind, tmp_path):
    path = write(kind, str(tmp_path / kind))
    ref = reference(kind, path, labels=True)
    run(tp_body, 2, kind, path, ref)


def tp_init_body(kind, ref, custom):
    mesh = pyparallel.init(tp=2)
    model = tp_parallelize(make(kind, meta=True), mesh, init=custom_init if custom else None)
    check_equal(full_parameters(model), ref, f"{kind} tp=2 init")
    return True


def custom_init(name, module):
    """An init callable: the module's own parameters from the (seeded) default generator."""
    for p in module.parameters(recurse=False):
        p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name or "ln" in name else 0.0))


@pytest.mark.parametrize("kind,custom", [("llama", False), ("gpt2", True)])
def test_tensor_parallel_init_equals_one_process_init(kind, custom):
    model = make(kind, meta=True)
    materialize.initialize(model, torch.device("cpu"), custom_init if custom else None)
    run(tp_init_body, 2, kind, {n: p.detach() for n, p in model.named_parameters()}, custom)


def sp_body(path, ref):
    """Sequence parallelism registers gradient hooks on parameters (LayerNorms and row biases see 1/t of the
    tokens: their gradients are all-reduced); on a meta model they are registered before the parameters get
    storage and must survive it."""
    mesh = pyparallel.init(tp=2)
    model = tp_parallelize(make("gpt", meta=True), mesh, sequence_parallel=True, weights=path)
    losses = tp_train("gpt", model)
    check_close(losses, full_parameters(model), ref, "gpt", "gpt tp=2 sp")
    return True


def test_tensor_parallel_sequence_parallel_hooks_survive_materialization(tmp_path):
    path = write("gpt", str(tmp_path / "gpt"))
    run(sp_body, 2, path, reference("gpt", path))


# -------------------------------------------------------------------------------------- pipeline parallel

M = 2  # micro-batches


def pp_train(kind, pipe):
    opt = torch.optim.AdamW(list(pipe.parameters()), lr=LR)
    losses = []
    for idx, tgt in data(kind):
        losses.append(pipe.step(idx, tgt))
        opt.step()
        opt.zero_grad()
    return losses


def pp_body(kind, path, ref):
    mesh = pyparallel.init(pp=2)
    model = make(kind, meta=True)
    pipe = PipelineParallel(model, mesh, num_microbatches=M, loss_fn=ce64, weights=path)
    mine = list(pipe.parameters())
    assert mine and not any(p.is_meta for p in mine)
    others = [p for p in model.parameters() if all(p is not q for q in mine)]
    assert others and all(p.is_meta for p in others)  # the other stage's tensors were never allocated
    check_equal(pipe.full_state_dict(), ref[0], f"{kind} pp=2 loaded")
    losses = pp_train(kind, pipe)
    check_close(losses, pipe.full_state_dict(), ref, kind, f"{kind} pp=2")
    tied = [p for p, _ in pipe._tied]
    return len(tied)


@pytest.mark.parametrize("kind", KINDS)
def test_pipeline_meta_model_with_weights_equals_one_process(kind, tmp_path):
    path = write(kind, str(tmp_path / kind))
    tied = run(pp_body, 2, kind, path, reference(kind, path))
    assert tied == ([0, 0] if kind == "qwen2" else [1, 1])  # the tied embedding / head: loaded on both stages


def pp_init_body(kind, ref):
    mesh = pyparallel.init(pp=2)
    pipe = PipelineParallel(make(kind, meta=True), mesh, num_microbatches=M, loss_fn=ce64)
    check_equal(pipe.full_state_dict(), ref, f"{kind} pp=2 init")
    return True


def test_pipeline_init_equals_one_process_init():
    for kind in ("gpt2", "qwen2"):
        model = make(kind, meta=True)
        materialize.initialize(model, torch.device("cpu"))
        run(pp_init_body, 2, kind, {n: p.detach() for n, p in model.named_parameters()})


# ------------------------------------------------------------------------- pyparallel.parallelize layouts


def combined_model(kind, layout, stage, **source):
    dp, tp, pp = layout
    mesh = pyparallel.init(dp=dp, tp=tp, pp=pp)
    loss = {} if tp > 1 else {"loss_fn": ce64}  # under TP: the vocabulary-parallel loss (float64 kept)
    return pyparallel.parallelize(make(kind, meta=True), mesh, zero_stage=stage, num_microbatches=M if pp > 1 else 1,
                                  lr=LR, **loss, **source)


def combined_body(kind, layout, stage, path, ref):
    model = combined_model(kind, layout, stage, weights=path)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if stage == 3:  # only the ZeRO shards hold weights before the first step gathers them
        assert all(p.untyped_storage().size() == 0 for p in trainable)
        assert model.mesh.dp == 1 or model.engine.master.numel() < sum(p.numel() for p in trainable)
    check_equal(model.full_state_dict(), ref[0], f"{kind} {layout} zero {stage} loaded")
    losses = []
    for idx, tgt in data(kind):
        rows = model.batch_slice(BATCH)
        losses.append(model.step(idx[rows], tgt[rows]))
    check_close(losses, model.full_state_dict(), ref, kind, f"{kind} {layout} zero {stage}")
    return True


@pytest.mark.parametrize("kind,layout,stage", [
    ("gpt2", (2, 2, 1), 3),  # ZeRO-3 over TP shards, padded vocabulary, tied head
    ("llama", (1, 2, 2), 1),  # TP inside PP stages, the head tied across them
    ("qwen2", (2, 1, 2), 2),
    ("gpt", (1, 2, 2), 3),
])
def test_parallelize_meta_model_with_weights_equals_one_process(kind, layout, stage, tmp_path):
    path = write(kind, str(tmp_path / kind))
    run(combined_body, 4, kind, layout, stage, path, reference(kind, path))


def combined_init_body(kind, layout, stage, ref):
    model = combined_model(kind, layout, stage)
    check_equal(model.full_state_dict(), ref, f"{kind} {layout} zero {stage} init")
    return True


def test_parallelize_init_equals_one_process_init():
    model = make("llama", meta=True)
    materialize.initialize(model, torch.device("cpu"))
    run(combined_init_body, 4, "llama", (1, 2, 2), 3, {n: p.detach() for n, p in model.named_parameters()})


# ---------------------------------------------------------------------------------------- data parallel


def ddp_body(kind, path, ref, custom):
    mesh = pyparallel.init()
    module = make(kind, meta=True)
    model = DataParallel(module, mesh, weights=path, init=custom_init if custom else None)
    check_equal({n: p.detach() for n, p in module.named_parameters()}, ref[0], f"{kind} dp=2 {path or 'init'}")
    if path is None:
        return True
    opt = torch.optim.AdamW(module.parameters(), lr=LR)
    share = BATCH // mesh.dp
    rows = slice(mesh.dp_rank * share, (mesh.dp_rank + 1) * share)
    losses = []
    for idx, tgt in data(kind):
        loss = ce64(logits_of(model, idx[rows]), tgt[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        comm.all_reduce(total, mesh.dp_group, op="avg")
        losses.append(total.item())
    check_close(losses, {n: p.detach() for n, p in module.named_parameters()}, ref, kind, f"{kind} dp=2")
    return True


@pytest.mark.parametrize("kind", ["gpt", "gpt2"])
def test_data_parallel_meta_model_with_weights_equals_one_process(kind, tmp_path):
    path = write(kind, str(tmp_path / kind))
    run(ddp_body, 2, kind, path, reference(kind, path), False)


def test_data_parallel_init_equals_one_process_init():
    model = make("qwen2", meta=True)
    materialize.initialize(model, torch.device("cpu"), custom_init)
    run(ddp_body, 2, "qwen2", None, ({n: p.detach() for n, p in model.named_parameters()},), True)


# ------------------------------------------------------------------------------------------- bad input


class Scale(nn.Module):
    """A module holding a parameter with no reset_parameters() (and no Hugging Face _init_weights above it)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.w


def bad_body(cases):
    meshes = {"tp": pyparallel.init(tp=2), "pp": pyparallel.init(pp=2), "dp": pyparallel.init()}
    wrappers = {
        "tp": lambda m, **kw: tp_parallelize(m, meshes["tp"], **kw),
        "pp": lambda m, **kw: PipelineParallel(m, meshes["pp"], num_microbatches=2, **kw),
        "dp": lambda m, **kw: DataParallel(m, meshes["dp"], **kw),
        "parallelize": lambda m, **kw: pyparallel.parallelize(m, meshes["pp"], zero_stage=3, lr=LR, **kw),
    }
    before = comm.comm_stats()["total"]["calls"]
    messages = []
    for path, text in cases:
        for name, wrap in wrappers.items():
            with pytest.raises(ValueError, match=text) as info:
                wrap(make("gpt", meta=True), weights=path)
            messages.append(f"{name}: {info.value}")
    meta_gpt = make("gpt", meta=True)
    for wrap in wrappers.values():
        with pytest.raises(ValueError, match="pass weights= or init=, not both"):
            wrap(make("gpt", meta=True), weights=cases[0][0], init=custom_init)
        with pytest.raises(ValueError, match="init= only applies to a model built on the meta device"):
            wrap(make("gpt"), init=custom_init)
    with pytest.raises(ValueError, match=r"module '1' \(Scale\) holds meta parameters and has no reset_parameters"):
        with torch.device("meta"):
            odd = nn.Sequential(nn.Linear(4, 4), Scale())
        DataParallel(odd, meshes["dp"])
    with pytest.raises(ValueError, match="a block list or nn.Sequential cannot be built from weights= / init="):
        PipelineParallel(nn.Sequential(*meta_gpt.blocks), meshes["pp"], num_microbatches=2, loss_fn=ce64)
    assert comm.comm_stats()["total"]["calls"] == before  # every one before the first collective
    return messages


def test_bad_weights_are_refused_before_any_collective(tmp_path):
    good = {n: p.detach().float().contiguous() for n, p in make("gpt").named_parameters()}
    cases = []

    def case(name, tensors, text):
        folder = tmp_path / name
        folder.mkdir()
        save_file(tensors, str(folder / "model.safetensors"))
        cases.append((str(folder), text))

    missing = dict(good)
    missing.pop("blocks.1.attn.q_proj.weight")
    case("missing", missing, r"1 tensor\(s\) missing: blocks\.1\.attn\.q_proj\.weight")
    case("unexpected", {**good, "blocks.2.mlp.fc_in.weight": torch.zeros(2)}, r"unexpected: blocks\.2\.mlp\.fc_in")
    case("shape", {**good, "blocks.0.mlp.fc_in.weight": torch.zeros(128, 31)},
         r"wrong shape: blocks\.0\.mlp\.fc_in\.weight \(128, 31\) \(model: \(128, 32\)\)")
    messages = run(bad_body, 2, cases)
    assert messages[0] == messages[1]  # every rank says the same
