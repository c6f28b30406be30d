"""Meta-device models and streamed weights (``pyparallel.zero.setup(..., weights=...)`` / ``init=``): equal to
one process that loaded the same file or ran the same initialisation; bad files refused before training.

Weights are written by ``save_pretrained`` (a sharded Hugging Face folder with an index) or by
``safetensors.torch.save_file`` (one file), from small random-init models: nothing is downloaded.
"""

import json
import os

import pytest
import torch
import torch.nn.functional as F
from dist import run
from models import TINY, batches, hf_model
from safetensors.torch import save_file

import pyparallel
from pyparallel import comm, materialize, zero
from pyparallel.checkpoint.weights import WeightsReader, open_weights
from pyparallel.models.gpt import GPT, gpt_config

STEPS, BATCH, LR = 3, 8, 1e-2


def ce(outputs, targets):
    logits = outputs if torch.is_tensor(outputs) else outputs.logits
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def make(kind, meta=False, dtype=torch.float32):
    with torch.device("meta") if meta else torch.device("cpu"):
        if kind == "gpt":
            return GPT(gpt_config("tiny", **TINY)).to(dtype)
        return hf_model(kind, tie_word_embeddings=kind != "qwen2").to(dtype)


def write(kind, path, dtype=torch.float32):
    torch.manual_seed(1)
    model = make(kind)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))  # not the init a meta build would give
    if kind == "gpt":
        os.makedirs(path, exist_ok=True)
        save_file({n: p.detach().to(dtype).contiguous() for n, p in model.named_parameters()},
                  os.path.join(path, "model.safetensors"))
    else:
        model.to(dtype).save_pretrained(path, max_shard_size="20KB")  # several shards and an index
    return path


def one_process(model):
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for idx, tgt in batches(STEPS, BATCH):
        loss = ce(model(idx), tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def reference_from(kind, path, dtype=torch.float64):
    model = make(kind, meta=True, dtype=dtype)
    reader = open_weights(path, model)
    materialize.empty_params(model, torch.device("cpu"))
    materialize.rebuild_buffers(model, torch.device("cpu"), loadable={n for n, _ in model.named_parameters()})
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(reader.full("model/" + n))
    return one_process(model)


def sharded(model, opt, mesh):
    losses = []
    share = BATCH // mesh.dp
    rows = slice(mesh.dp_rank * share, (mesh.dp_rank + 1) * share)
    for idx, tgt in batches(STEPS, BATCH):
        loss = ce(model(idx[rows]), tgt[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = torch.tensor([loss.item()], dtype=torch.float64)
        comm.all_reduce(total, mesh.dp_group, op="avg")
        losses.append(float(total))
    return losses


def weights_body(kind, path, ref):
    mesh = pyparallel.init()
    for stage in (1, 2, 3):
        # float64: GPT-2's key bias has an analytically zero gradient, whose rounding noise Adam would
        # amplify differently under another summation order (see the built-in GPT, which has no key bias).
        model = make(kind, meta=True, dtype=torch.float64)
        zm, opt = zero.setup(model, mesh, stage=stage, lr=LR, weights=path, bucket_cap_mb=0.01)
        losses = sharded(zm, opt, mesh)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0]), msg=f"{kind} stage {stage}")
        full = zm.full_state_dict(torch.float64)
        assert full.keys() == ref[1].keys()
        for n, p in ref[1].items():
            torch.testing.assert_close(full[n], p, msg=lambda m, n=n, s=stage: f"{kind} stage {s} {n}: {m}")
    return True


@pytest.mark.parametrize("kind", ["gpt", "llama", "gpt2", "qwen2"])
def test_meta_model_with_weights_equals_one_process(kind, tmp_path):
    path = write(kind, str(tmp_path / kind))
    if kind != "gpt":
        assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))  # really sharded
    run(weights_body, 2, kind, path, reference_from(kind, path))


def bf16_body(path, ref):
    mesh = pyparallel.init()
    zm, opt = zero.setup(make("llama", meta=True), mesh, stage=3, lr=LR, weights=path)
    assert zm.engine.master.dtype == torch.float32  # a bf16 checkpoint into fp32 masters
    losses = sharded(zm, opt, mesh)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0]))
    return True


def test_bf16_checkpoint_into_fp32_masters(tmp_path):
    path = write("llama", str(tmp_path / "bf16"), dtype=torch.bfloat16)
    run(bf16_body, 2, path, reference_from("llama", path, torch.float32))


def init_body(ref):
    mesh = pyparallel.init()
    zm, opt = zero.setup(make("llama", meta=True), mesh, stage=3, lr=LR)
    losses = sharded(zm, opt, mesh)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0]))
    full = zm.full_state_dict()
    for n, p in ref[1].items():
        torch.testing.assert_close(full[n], p, msg=n)
    return True


def test_meta_model_without_weights_equals_the_same_init_in_one_process():
    model = make("llama", meta=True)
    materialize.initialize(model, torch.device("cpu"))
    assert not materialize.has_meta(model)
    run(init_body, 2, one_process(model))


def bad_body(cases):
    mesh = pyparallel.init()
    messages = []
    for path, text in cases:
        with pytest.raises(ValueError, match=text) as info:
            zero.setup(make("gpt", meta=True), mesh, stage=3, lr=LR, weights=path)
        messages.append(str(info.value))
    assert comm.comm_stats()["total"]["calls"] == 0  # every one before the first collective
    return messages


def test_bad_weights_are_refused_before_training(tmp_path):
    good = {n: p.detach().contiguous() for n, p in make("gpt").named_parameters()}
    cases = []

    def case(name, tensors, text):
        folder = tmp_path / name
        folder.mkdir()
        save_file(tensors, str(folder / "model.safetensors"))
        cases.append((str(folder), text))

    missing = dict(good)
    missing.pop("blocks.1.mlp.fc_in.weight")
    case("missing", missing, r"1 tensor\(s\) missing: blocks.1.mlp.fc_in.weight")
    case("unexpected", {**good, "extra.weight": torch.zeros(2)}, r"unexpected: extra.weight")
    case("shape", {**good, "head.ln_f.weight": torch.zeros(7)}, r"wrong shape: head.ln_f.weight \(7,\)")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "model.safetensors").write_bytes(b"this is not a safetensors file")
    cases.append((str(tmp_path / "junk"), "junk/model.safetensors is not a readable safetensors file"))
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: "model-00001-of-00002.safetensors" for n in good}}))
    cases.append((str(tmp_path / "index"), "names shard\\(s\\) that do not exist: model-00001-of-00002"))
    cases.append((str(tmp_path / "nowhere"), "does not exist"))
    messages = run(bad_body, 2, cases)
    assert messages[0] == messages[1]


def test_reader_reads_only_the_box(tmp_path):
    """A piece is the box's rows of the stored tensor, permuted, then its flat range."""
    from pyparallel.checkpoint.format import Piece

    t = torch.arange(6 * 4, dtype=torch.float32).view(6, 4)
    save_file({"w": t}, str(tmp_path / "w.safetensors"))
    reader = WeightsReader(str(tmp_path / "w.safetensors"))
    piece = Piece("model/w", (6, 4), (2, 1), (3, 2), 1, 4, perm=(1, 0))
    assert torch.equal(reader.piece(piece), t[2:5, 1:3].permute(1, 0).reshape(-1)[1:5])
