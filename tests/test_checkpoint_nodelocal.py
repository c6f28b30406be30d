"""Node-local checkpoint storage (``storage="node-local"``) on one host: each rank is given a checkpoint
root of its own, so every rank is a "node" with its own disk (tests/test_multinode.py does it with two real
test hosts). Same-layout resume is bit-exact, each folder holds only its node's files, a load that needs a
piece of another node fails on every rank with the piece and the node named, a crash between two nodes'
commits leaves a save every node holds, and ``pyparallel train --checkpoint-storage node-local`` resumes."""

import json
import os
import shutil

import pytest
import torch
from dist import run
from models import Net, adamw, batches
from zero_common import LR, WD, ZNet

import pyparallel
from pyparallel import checkpoint, zero
from pyparallel import train as train_mod
from pyparallel.checkpoint import store

BATCH = 8


def _build(kind, mesh):
    """(object to save/load, its optimizer, one training step returning this rank's loss)."""
    if kind == "ddp":
        model = Net()
        wrapped = pyparallel.DataParallel(model, mesh)
        opt = adamw(model)
    else:
        wrapped = zero.setup(ZNet(), mesh, stage=int(kind[-1]), optimizer=torch.optim.AdamW, lr=LR, weight_decay=WD)
        wrapped, opt = wrapped
    local = BATCH // mesh.dp
    rows = slice(mesh.dp_rank * local, (mesh.dp_rank + 1) * local)

    def step(idx, tgt):
        loss = wrapped(idx[rows], tgt[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    return wrapped, opt, step


def _own_root(base, rank):
    return os.path.join(base, f"node{rank}", "ckpt")


def _error(fn):
    try:
        fn()
    except checkpoint.CheckpointError as exc:
        return str(exc)
    return None


def same_layout_body(base, kind):
    mesh = pyparallel.init()
    root = _own_root(base, mesh.rank)
    data = batches(5, BATCH)
    _, _, step = _build(kind, mesh)
    whole = [step(*d) for d in data]
    model, opt, step = _build(kind, mesh)
    first = [step(*d) for d in data[:3]]
    folder = checkpoint.save(root, model, opt, step=3, storage="node-local")
    with open(os.path.join(folder, "manifest.json")) as f:
        manifest = json.load(f)
    model, opt, step = _build(kind, mesh)
    info = checkpoint.load(root, model, opt, storage="node-local")
    resumed = [step(*d) for d in data[3:]]
    # The folders swapped (the ranks landed on each other's node): every rank refuses, none loads half.
    model, opt, _ = _build(kind, mesh)
    swapped = _error(lambda: checkpoint.load(_own_root(base, 1 - mesh.rank), model, opt, storage="node-local"))
    return {"whole": whole, "first": first, "resumed": resumed, "step": info["step"],
            "files": sorted(os.listdir(folder)), "nodes": [n["ranks"] for n in manifest["nodes"]],
            "node": manifest["node"], "copies": len(manifest["copies"]), "swapped": swapped}


@pytest.mark.parametrize("kind", ["ddp", "zero1"])
def test_node_local_save_resumes_exactly_in_the_same_layout(tmp_path, kind):
    base = str(tmp_path)
    res = run(same_layout_body, 2, base, kind)
    for rank, r in enumerate(res):
        assert r["step"] == 3
        assert r["first"] + r["resumed"] == r["whole"], rank  # bit for bit
        assert r["files"] == ["manifest.json", f"rank-{rank:05d}.safetensors"]  # its node's pieces only
        assert r["nodes"] == [[0], [1]] and r["node"] == rank
    # DDP: rank 1 is a replica whose pieces rank 0 writes canonically, so node 1 keeps copies of them, and
    # either node's folder restores either rank. ZeRO-1: every rank writes its own shards (node 1 copies only
    # the small scalars, Adam's step), so a rank on the other node's folder lacks its shards: every rank
    # raises the same error, naming the pieces, who needs them and the node whose folder holds them.
    if kind == "ddp":
        assert res[0]["copies"] == 0 and res[1]["copies"] > 0
        assert res[0]["swapped"] is None and res[1]["swapped"] is None
    else:
        assert 0 < res[0]["copies"] and 0 < res[1]["copies"]  # the other node's Adam steps
        err = res[0]["swapped"]
        assert err is not None and err == res[1]["swapped"]
        assert "pieces that ranks need are not in their own node's folder" in err
        assert "rank 0 (" in err and "rank 1 (" in err
        assert "in rank-00001.safetensors on node 1 (" in err and "in rank-00000.safetensors on node 0 (" in err

    # One process, one node's folder: the shared-storage load refuses it and says what to do; node-local
    # names the pieces on node 1. Copying node 1's file into node 0's folder makes a whole checkpoint.
    node0 = checkpoint.resolve(_own_root(base, 0))
    node1 = checkpoint.resolve(_own_root(base, 1))
    model = Net() if kind == "ddp" else ZNet()
    if kind == "zero1":
        with pytest.raises(checkpoint.CheckpointError, match="saved with storage='node-local'"):
            checkpoint.load(node0, model)
        with pytest.raises(checkpoint.CheckpointError, match=r"rank-00001.safetensors on node 1 \("):
            checkpoint.load(node0, model, storage="node-local")
        with pytest.raises(checkpoint.CheckpointError, match="saved with storage='node-local'"):
            checkpoint.read_tensors(node0)
    shutil.copy(os.path.join(node1, "rank-00001.safetensors"), node0)
    merged = checkpoint.read_tensors(node0, "model/")
    alone = Net() if kind == "ddp" else ZNet()
    checkpoint.load(node0, alone)
    for name, p in alone.named_parameters():
        torch.testing.assert_close(p.detach(), merged["model/" + name], rtol=0, atol=0, msg=name)
    checkpoint.export_consolidated(node0, str(tmp_path / "model.safetensors"))


def resharded_body(base, shared):
    """Saved by ZeRO-1, loaded as DDP: every rank needs whole tensors whose shards are on both nodes."""
    mesh = pyparallel.init()
    root = os.path.join(base, "ckpt") if shared else _own_root(base, mesh.rank)
    model, opt, step = _build("zero1", mesh)
    for d in batches(2, BATCH):
        step(*d)
    checkpoint.save(root, model, opt, step=2, storage="node-local")
    expected = model.full_state_dict()
    plain = ZNet()
    popt = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    ddp = pyparallel.DataParallel(plain, mesh)
    err = _error(lambda: checkpoint.load(root, ddp, popt, storage="node-local"))
    same = err is None and all(torch.equal(p.detach(), expected[n]) for n, p in plain.named_parameters())
    return err, same


def test_another_layout_loads_where_the_node_holds_every_piece_and_fails_everywhere_where_not(tmp_path):
    errs = [e for e, _ in run(resharded_body, 2, str(tmp_path / "own"), False)]
    assert errs[0] is not None and errs[0] == errs[1]
    assert "rank 0 (" in errs[0] and "needs model/" in errs[0] and "on node 1 (" in errs[0]
    assert "the layout it was saved with (dp=2 x tp=1 x pp=1, the same strategy and ZeRO stage)" in errs[0]
    # One folder both ranks see: one storage node holding everything, so any layout loads from it.
    res = run(resharded_body, 2, str(tmp_path / "one"), True)
    assert res == [(None, True), (None, True)]


def sharing_body(base):
    """Rank 1 names rank 0's folder through a symlink: the probes find that they share it."""
    mesh = pyparallel.init()
    real = os.path.join(base, "real")
    if mesh.rank == 0:
        os.makedirs(real, exist_ok=True)
        if not os.path.lexists(os.path.join(base, "alias")):
            os.symlink(real, os.path.join(base, "alias"))
    pyparallel.comm.barrier(mesh.world_group)
    root = real if mesh.rank == 0 else os.path.join(base, "alias")
    model, opt, step = _build("zero1", mesh)
    step(*batches(1, BATCH)[0])
    folder = checkpoint.save(root, model, opt, step=1, storage="node-local")
    with open(os.path.join(folder, "manifest.json")) as f:
        manifest = json.load(f)
    model, opt, _ = _build("zero1", mesh)
    checkpoint.load(root, model, opt, storage="node-local")
    return [n["ranks"] for n in manifest["nodes"]], sorted(os.listdir(folder))


def test_ranks_that_see_one_folder_under_different_paths_are_one_node(tmp_path):
    for nodes, files in run(sharing_body, 2, str(tmp_path)):
        assert nodes == [[0, 1]]
        assert files == ["manifest.json", "rank-00000.safetensors", "rank-00001.safetensors"]
    checkpoint.load(str(tmp_path / "real"), ZNet())  # a whole checkpoint: the shared-storage load reads it


def shared_refusal_body(base):
    mesh = pyparallel.init()
    model, opt, step = _build("zero1", mesh)
    step(*batches(1, BATCH)[0])
    return _error(lambda: checkpoint.save(_own_root(base, mesh.rank), model, opt, step=1))


def test_the_default_storage_still_refuses_node_local_folders(tmp_path):
    for err in run(shared_refusal_body, 2, str(tmp_path)):
        assert err is not None and "node-local directories are not supported" in err
    assert not os.path.exists(os.path.join(_own_root(str(tmp_path), 0), "latest"))


def crash_body(base):
    """Step 2 saved; the re-save of step 2 fails on node 1 after node 0 committed it: every node still
    holds the first save of step 2, and that is what a resume finds."""
    mesh = pyparallel.init()
    root = _own_root(base, mesh.rank)
    model, opt, step = _build("zero1", mesh)
    data = batches(4, BATCH)
    for d in data[:2]:
        step(*d)
    first = checkpoint.save(root, model, opt, step=2, storage="node-local")
    nothing = _error(lambda: checkpoint.newest_common(os.path.join(base, "nowhere", str(mesh.rank)), mesh))
    if mesh.rank == 1:
        store._before_commit = lambda: (_ for _ in ()).throw(OSError("disk full (injected)"))
    try:
        failed = _error(lambda: checkpoint.save(root, model, opt, step=2, extra={"again": 1}, storage="node-local"))
    except OSError as exc:
        failed = f"OSError: {exc}"
    finally:
        store._before_commit = lambda: None
    latest = open(os.path.join(root, "latest")).read().strip()
    common = checkpoint.newest_common(root, mesh)
    differ = _error(lambda: checkpoint.load(root, *_build("zero1", mesh)[:2], storage="node-local"))
    model2, opt2, step2 = _build("zero1", mesh)
    info = checkpoint.load(common, model2, opt2, storage="node-local")
    resumed = [step2(*d) for d in data[2:]]
    # One node without a checkpoint while the other has one: refused on every rank, not a restart from 0.
    lonely = os.path.join(base, "lonely", str(mesh.rank))
    if mesh.rank == 0:
        shutil.copytree(os.path.dirname(first), lonely)
    pyparallel.comm.barrier(mesh.world_group)
    empty = _error(lambda: checkpoint.newest_common(lonely, mesh))
    return {"first": os.path.basename(first), "failed": failed, "latest": latest, "common": os.path.basename(common),
            "differ": differ, "extra": info["extra"], "steps": sorted(os.listdir(root)), "nothing": nothing,
            "empty": empty, "resumed": resumed}


def test_a_crash_between_two_nodes_commits_leaves_a_save_every_node_holds(tmp_path):
    res = run(crash_body, 2, str(tmp_path))
    r0, r1 = res
    assert "disk full (injected)" in r0["failed"] and "disk full (injected)" in r1["failed"]
    assert r0["latest"] == "step-00000002.1" and r1["latest"] == "step-00000002"  # node 0 had committed
    assert r0["steps"] == ["latest", "step-00000002", "step-00000002.1"]  # the older copy kept: not common yet
    assert r0["common"] == r1["common"] == "step-00000002" and r0["extra"] == r1["extra"] == {}
    for r in res:
        assert r["nothing"] is None
        assert "hold different saves" in r["differ"] and "newest_common" in r["differ"]
        assert "no checkpoint under" in r["empty"] and "is complete on every node" in r["empty"]
        assert "nothing" in r["empty"]
    assert r0["empty"].split("is complete")[1] == r1["empty"].split("is complete")[1]  # roots differ here


def train_body(base, argv):
    """``pyparallel train`` with each rank's --checkpoint-dir its own folder (two "nodes")."""
    rank = int(os.environ["RANK"])
    own = ["--checkpoint-dir", _own_root(base, rank), "--checkpoint-storage", "node-local"]
    common = ["--batch", "8", "--seq", "16", "--no-progress", "--model", "tiny", *argv]
    whole = train_mod.train(train_mod.build_parser().parse_args([*common, "--steps", "4"]))["losses"]
    first = train_mod.train(train_mod.build_parser().parse_args([*common, "--steps", "2", "--save-every", "1", *own]))
    again = train_mod.train(train_mod.build_parser().parse_args([*common, "--steps", "4", "--resume", *own]))
    return whole, first["losses"], again["start"], again["losses"]


@pytest.mark.parametrize("layout", [["--dp", "2", "--zero", "1"], ["--dp", "2"], ["--pp", "2", "--micro-batches", "2"],
                                    ["--tp", "2", "--zero", "2"]])
def test_train_resumes_from_node_local_folders(tmp_path, layout):
    whole, first, start, again = run(train_body, 2, str(tmp_path), layout)[0]
    assert start == 2 and first + again == whole
    for rank in (0, 1):
        steps = sorted(os.listdir(_own_root(str(tmp_path), rank)))
        assert steps == ["latest", "step-00000001", "step-00000002", "step-00000004"]
