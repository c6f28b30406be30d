"""Checkpoints: layout-independent load, bit-exact resume, crash safety, corruption detection, export."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from dist import run
from models import Net, adamw, batches
from safetensors.torch import load_file

import pyparallel
from pyparallel import checkpoint


def _train(model, opt, data, wrapped=None):
    losses = []
    for idx, tgt in data:
        loss = (wrapped or model)(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def ddp_save_body(root):
    mesh = pyparallel.init()
    model = Net()
    ddp = pyparallel.DataParallel(model, mesh)
    opt = adamw(model)
    local = 8 // mesh.dp
    data = [(i[mesh.dp_rank * local:(mesh.dp_rank + 1) * local], t[mesh.dp_rank * local:(mesh.dp_rank + 1) * local])
            for i, t in batches(3, 8)]
    _train(model, opt, data, ddp)
    checkpoint.save(root, ddp, opt, step=3, extra={"note": "dp2"}, mesh=mesh)
    return sorted(os.listdir(root))


def test_ddp_checkpoint_loads_into_one_process_and_resumes_exactly(tmp_path):
    root = str(tmp_path / "ckpt")
    assert run(ddp_save_body, 2, root)[0] == ["latest", "step-00000003"]
    # Uninterrupted single-process run of 5 steps on the whole batch.
    ref = Net()
    ref_opt = adamw(ref)
    ref_losses = _train(ref, ref_opt, batches(5, 8))
    # Resume at step 3 from the 2-rank checkpoint, in one process.
    model = Net(n_layer=2)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # prove the weights come from the checkpoint
    opt = adamw(model)
    meta = checkpoint.load(root, model, opt)
    assert meta["step"] == 3 and meta["extra"] == {"note": "dp2"} and meta["layout"]["dp"] == 2
    losses = _train(model, opt, batches(5, 8)[3:])
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[3:]))
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, msg=n)


def test_resume_is_bit_exact_in_one_process(tmp_path):
    data = batches(6, 4)
    ref = Net()
    ref_losses = _train(ref, adamw(ref), data)
    model = Net()
    opt = adamw(model)
    first = _train(model, opt, data[:3])
    checkpoint.save(str(tmp_path), model, opt, step=3)
    resumed = Net()
    ropt = adamw(resumed)
    checkpoint.load(str(tmp_path), resumed, ropt)
    assert first + _train(resumed, ropt, data[3:]) == ref_losses  # bit for bit, not approximately


def test_load_refuses_corrupt_and_incomplete_checkpoints(tmp_path):
    model, opt = Net(), None
    folder = checkpoint.save(str(tmp_path), model, opt, step=1)
    data_file = os.path.join(folder, "rank-00000.safetensors")
    with open(data_file, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"xyz")
    with pytest.raises(checkpoint.CheckpointError, match="rank-00000.safetensors does not match its checksum"):
        checkpoint.load(str(tmp_path), Net())
    os.remove(os.path.join(folder, "manifest.json"))
    with pytest.raises(checkpoint.CheckpointError, match="manifest.json is missing"):
        checkpoint.load(folder, Net())


CRASH_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from models import Net
    from pyparallel import checkpoint
    model = Net()
    with __import__("torch").no_grad():
        for p in model.parameters():
            p.add_(1.0)
    checkpoint.store._before_commit = lambda: os.kill(os.getpid(), signal.SIGKILL)  # die before the manifest
    checkpoint.save({root!r}, model, None, step=2)
""")


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    root = str(tmp_path)
    model = Net()
    checkpoint.save(root, model, None, step=1)
    script = CRASH_SCRIPT.format(tests=os.path.dirname(__file__), root=root)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert os.path.isdir(os.path.join(root, ".tmp-step-00000002"))  # the half-written save is there...
    assert not os.path.exists(os.path.join(root, "step-00000002"))
    fresh = Net()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    assert checkpoint.load(root, fresh)["step"] == 1  # ...but `latest` still names step 1, intact
    for p, q in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(p, q)
    with pytest.raises(checkpoint.CheckpointError, match="manifest.json is missing"):
        checkpoint.load(os.path.join(root, ".tmp-step-00000002"), fresh)


def test_export_consolidated_is_loadable_by_the_plain_model(tmp_path):
    model = Net()
    checkpoint.save(str(tmp_path / "c"), model, None, step=1)
    keys = checkpoint.export_consolidated(str(tmp_path / "c"), str(tmp_path / "model.safetensors"))
    state = load_file(str(tmp_path / "model.safetensors"))
    assert set(keys) == set(state)
    fresh = Net()
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    assert unexpected == [] and missing == ["gpt.head.lm_head.weight"]  # tied to the embedding, stored once
    for (n, p), q in zip(fresh.named_parameters(), model.parameters()):
        assert torch.equal(p, q), n


def test_a_broken_latest_is_named_and_the_newest_complete_step_found(tmp_path):
    root = str(tmp_path)
    checkpoint.save(root, Net(), None, step=1)
    second = checkpoint.save(root, Net(), None, step=2)
    shutil.rmtree(second)  # `latest` now names a folder that is gone
    with pytest.raises(checkpoint.CheckpointError, match=r"names 'step-00000002', which does not exist.*"
                                                         r"Complete steps here: \['step-00000001'\]"):
        checkpoint.load(root, Net())
    os.makedirs(second)
    with pytest.raises(checkpoint.CheckpointError, match="names 'step-00000002', an empty folder"):
        checkpoint.load(root, Net())
    assert checkpoint.newest_complete(root) == os.path.join(root, "step-00000001")
    with open(os.path.join(root, "latest"), "w"):
        pass
    with pytest.raises(checkpoint.CheckpointError, match="latest' is empty"):
        checkpoint.resolve(root)


def test_resaving_a_step_switches_latest_to_a_fresh_folder(tmp_path):
    root = str(tmp_path)
    first = checkpoint.save(root, Net(), None, step=3)
    model = Net()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    again = checkpoint.save(root, model, None, step=3)
    assert again != first and os.path.basename(again) == "step-00000003.1"
    assert sorted(os.listdir(root)) == ["latest", "step-00000003.1"]  # the old copy went after the switch
    fresh = Net()
    assert checkpoint.load(root, fresh)["step"] == 3
    for p, q in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(p, q)
    with pytest.raises(checkpoint.CheckpointError, match="is a file, not a folder"):
        checkpoint.save(os.path.join(root, "latest"), Net(), None, step=1)


class _Failing(torch.nn.Module):
    """Rank 1 cannot describe its pieces (a bug in a wrapper, a full disk): every rank must hear of it."""

    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh
        self.w = torch.nn.Parameter(torch.ones(2))

    def checkpoint_pieces(self):
        if self.mesh.rank == 1:
            raise OSError("no space left on device (simulated)")
        return [(checkpoint.Piece.whole("model/w", (2,)), self.w)]


def failing_save_body(root):
    mesh = pyparallel.init(timeout_s=60)
    try:
        checkpoint.save(root, _Failing(mesh), step=1, mesh=mesh)
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)
    return None


def test_an_error_on_one_rank_during_save_is_raised_on_every_rank(tmp_path):
    out = run(failing_save_body, 2, str(tmp_path))
    assert out[1] == ("OSError", "no space left on device (simulated)")
    assert out[0][0] == "CheckpointError"
    assert "failed on rank 1 while writing its pieces: OSError: no space" in out[0][1]
    assert not os.path.exists(tmp_path / "latest")
