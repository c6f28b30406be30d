"""``checkpoint.export_pretrained``: a checkpoint saved by 2 ZeRO-3 ranks (or 2 tensor-parallel ranks) becomes a
Hugging Face folder -- several shards, an index, config.json -- that ``from_pretrained`` loads into exactly the
trained parameters; the exporting process holds one tensor at a time (its peak RSS, measured in a fresh
process, is a small fraction of the model); bad input is refused naming the problem."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from dist import run
from models import batches, hf_model

import pyparallel
from pyparallel import checkpoint, zero
from pyparallel.checkpoint.export import parse_size

BATCH, LR = 4, 1e-2


def _loss(model, idx, tgt):
    return F.cross_entropy(model(idx).logits.flatten(0, 1), tgt.flatten())


def zero3_body(kind, root):
    """Train two AdamW steps under ZeRO-3 on 2 ranks, save; rank 0 returns the full trained weights."""
    mesh = pyparallel.init()
    zm, opt = zero.setup(hf_model(kind), mesh, stage=3, lr=LR)
    share = slice(mesh.dp_rank * BATCH // 2, (mesh.dp_rank + 1) * BATCH // 2)
    for idx, tgt in batches(2, BATCH):
        _loss(zm, idx[share], tgt[share]).backward()
        opt.step()
        opt.zero_grad()
    checkpoint.save(root, zm, opt, step=2, mesh=mesh)
    return zm.full_state_dict()


def _check_folder(out, trained, kind):
    import transformers
    from safetensors import safe_open

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert len(shards) >= 3 and set(index["weight_map"].values()) == set(shards)
    assert all(f"-of-{len(shards):05d}.safetensors" in f for f in shards)
    total = 0
    for shard in shards:  # the index says where each tensor is, and the sizes add up
        with safe_open(str(out / shard), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for key in f.keys():
                assert index["weight_map"][key] == shard
                t = f.get_tensor(key)
                total += t.numel() * t.element_size()
    assert index["metadata"]["total_size"] == total
    assert (out / "config.json").exists()  # recorded by checkpoint.save from the model's config
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert loaded.config.model_type == kind
    state = dict(loaded.named_parameters())
    assert set(state) == set(trained)
    for name, value in trained.items():
        assert torch.equal(state[name].detach(), value), name
    return loaded, index


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_zero3_checkpoint_exports_to_a_folder_from_pretrained_loads(kind, tmp_path):
    root = str(tmp_path / "ckpt")
    trained = run(zero3_body, 2, kind, root)[0]
    manifest = checkpoint.read_manifest(checkpoint.resolve(root))
    assert manifest["hf_config"]["model_type"] == kind
    out = tmp_path / "hf"
    index = checkpoint.export_pretrained(root, str(out), max_shard_size="20KB")
    loaded, on_disk = _check_folder(out, trained, kind)
    assert index == on_disk
    if kind == "gpt2":  # tied: stored once under its source name, as save_pretrained does, and tied again
        assert "transformer.wte.weight" in index["weight_map"] and "lm_head.weight" not in index["weight_map"]
        assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    else:  # untied: both; the rotary inv_freq buffer (non-persistent, saved in the checkpoint) left out
        assert "lm_head.weight" in index["weight_map"] and not any("inv_freq" in k for k in index["weight_map"])
    # the same names and sizes save_pretrained writes for the same model
    ref = tmp_path / "ref"
    loaded.save_pretrained(str(ref), max_shard_size="20KB")
    ref_index = json.loads((ref / "model.safetensors.index.json").read_text())
    assert set(ref_index["weight_map"]) == set(index["weight_map"])
    assert ref_index["metadata"]["total_size"] == index["metadata"]["total_size"]
    # a re-export with larger shards replaces the old ones; one shard is one model.safetensors, no index
    checkpoint.export_pretrained(root, str(out), max_shard_size="10MB")
    assert sorted(f for f in os.listdir(out) if "safetensors" in f) == ["model.safetensors"]
    again = type(loaded).from_pretrained(str(out))
    for name, value in trained.items():
        assert torch.equal(dict(again.named_parameters())[name].detach(), value), name


def layout_body(root, tp, pp):
    """GPT-2 through pyparallel.parallelize at tp=2 (pieces are boxes, transposed for Conv1D, not flat
    ranges) or pp=2 (each stage writes whole parameters, the tied embedding by its first stage)."""
    mesh = pyparallel.init(tp=tp, pp=pp)
    pm = pyparallel.parallelize(hf_model("gpt2"), mesh, lr=LR, num_microbatches=2 if pp > 1 else None)
    sl = pm.batch_slice(BATCH)
    for idx, tgt in batches(2, BATCH):
        pm.step(idx[sl], tgt[sl])
    checkpoint.save(root, pm, pm.optimizer, step=2, mesh=mesh)
    return pm.full_state_dict()


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_tensor_and_pipeline_parallel_checkpoints_export(tp, pp, tmp_path):
    root = str(tmp_path / "ckpt")
    full = run(layout_body, 2, root, tp, pp)[0]
    out = tmp_path / "hf"
    config = hf_model("gpt2").config  # given here; parallelize's model would have recorded it too
    checkpoint.export_pretrained(root, str(out), max_shard_size="20KB", config=config, dtype=torch.bfloat16)
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert loaded.dtype == torch.bfloat16
    state = dict(loaded.named_parameters())
    assert set(state) == set(full)
    for name, value in full.items():
        assert torch.equal(state[name].detach(), value.to(torch.bfloat16)), name


PEAK_SCRIPT = textwrap.dedent("""
    import sys
    import torch, safetensors.torch
    from pyparallel import checkpoint
    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key)) / 1024
    base = status("VmRSS")
    checkpoint.export_pretrained(sys.argv[1], sys.argv[2], max_shard_size="24MB")
    print(status("VmHWM") - base)
""")


def big_body(root):
    """64 MiB of fp32 in 64 tensors of 1 MiB, sharded by ZeRO-3 over 2 ranks."""
    mesh = pyparallel.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(64)])
    zm, opt = zero.setup(model, mesh, stage=3, lr=LR)
    checkpoint.save(root, zm, None, step=0, mesh=mesh)
    return True


def test_exporting_holds_one_tensor_not_the_model(tmp_path):
    """Peak resident memory (VmHWM: ru_maxrss would carry the pytest process's peak over exec) of a fresh
    process exporting a 64 MiB model (largest tensor 1 MiB) into 24 MB shards, above its RSS after imports:
    streaming needs a few MiB (one tensor, one piece, lazy imports; 7 MiB measured); gathering the model, or
    staging one shard, would need 64 or 23. Bound: 16 MiB."""
    root = str(tmp_path / "big")
    run(big_body, 2, root)
    out = str(tmp_path / "hf")
    res = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, root, out], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert res.returncode == 0, res.stderr
    peak = float(res.stdout.strip().splitlines()[-1])
    index = json.loads(open(os.path.join(out, "model.safetensors.index.json")).read())
    assert index["metadata"]["total_size"] == 64 * 2**20 and len(set(index["weight_map"].values())) == 3
    assert peak < 16, f"exporting a 64 MiB model peaked at {peak:.1f} MiB above its start"
    print(f"export peak above start: {peak:.1f} MiB")
    from safetensors.torch import load_file

    got = load_file(os.path.join(out, "model-00002-of-00003.safetensors"))
    full = checkpoint.read_tensors(root, "model/")
    for k, v in got.items():
        assert torch.equal(v, full["model/" + k]), k


def test_sizes_parse_as_save_pretrained_reads_them():
    assert parse_size("2GB") == 2 * 10**9 and parse_size("20KB") == 20_000 and parse_size("1GiB") == 2**30
    assert parse_size(" 1.5 mb ") == 1_500_000 and parse_size(4096) == 4096
    for bad in ("lots", "12XB", "-5MB", 0, -3, None, True, "GB"):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)


def single_body(root):
    mesh = pyparallel.init()
    zm, opt = zero.setup(hf_model("llama"), mesh, stage=3, lr=LR)
    checkpoint.save(root, zm, opt, step=1, mesh=mesh)
    return True


def test_bad_input_is_refused_naming_the_problem(tmp_path):
    root = str(tmp_path / "ckpt")
    run(single_body, 2, root)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="out_dir .*file.* is a file"):
        checkpoint.export_pretrained(root, str(tmp_path / "file"))
    with pytest.raises(ValueError, match="max_shard_size 'huge' is not a size"):
        checkpoint.export_pretrained(root, str(tmp_path / "o"), max_shard_size="huge")
    (tmp_path / "empty").mkdir()
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint at"):
        checkpoint.export_pretrained(str(tmp_path / "empty"), str(tmp_path / "o"))
    hf_model("llama").save_pretrained(str(tmp_path / "hfdir"))
    with pytest.raises(checkpoint.CheckpointError, match="is a Hugging Face weights folder"):
        checkpoint.export_pretrained(str(tmp_path / "hfdir"), str(tmp_path / "o"))
    with pytest.raises(checkpoint.CheckpointError, match="does not fit its Hugging Face config .*missing: transformer"
                                                          ".wpe.weight.*not in the model: model.embed_tokens"):
        checkpoint.export_pretrained(root, str(tmp_path / "o"), config=hf_model("gpt2").config)
    with pytest.raises(ValueError, match="neither a config.json"):
        checkpoint.export_pretrained(root, str(tmp_path / "o"), config=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="is the checkpoint folder itself"):
        checkpoint.export_pretrained(root, checkpoint.resolve(root))
    assert not (tmp_path / "o").exists()  # nothing written before the checks
